"""Verifiable rewards: a registry of ``reward(prompt_record, completion_text) -> float``.

A reward reads the prompt record (see :mod:`logra_megatron.rl.tasks`: ``prompt``, ``answer``,
``task``, ``metadata``) and the decoded completion, and returns a float, usually in [0, 1].
Rewards are registered by name with :func:`register_reward` and looked up with
:func:`get_reward`, so a config names its reward and new verifiers plug in without touching the
trainer. Registered here:

- ``exact_match``: the completion, stripped of surrounding whitespace, equals the reference
  answer (the embedded arithmetic task: ``"12+7="`` -> ``"19"``). Strict on purpose: the
  policy must also learn to stop after the answer.
- ``final_answer``: the answer the completion states (:func:`extract_final_answer`: an
  ``<answer>`` tag, ``\\boxed{}``, ``#### X``, ``Answer: X``, else the last number) equals the
  reference, as text or as a number (``1,000`` = ``1000.0``). The default of short-answer tasks
  shown through a chat template, whose instruction asks for ``\\boxed{}``.
- ``reasoning_gym`` (dispatching on ``record["task"]``, the default of every reasoning-gym task)
  and one reward per offline reasoning-gym dataset by its name (``basic_arithmetic``,
  ``chain_sum``, ``gsm_symbolic``, ...): the final answer is extracted from the completion with
  :func:`extract_final_answer` and scored by reasoning-gym's own ``score_answer`` for that
  dataset, so its rules hold (e.g. ``basic_arithmetic`` gives partial credit
  ``len(answer)/len(extracted)`` when the reference is a substring, ``gsm_symbolic`` gives 0.01
  for a wrong number).
- ``math_verify``: symbolic equivalence of the completion's answer and the reference with
  math-verify (``\\boxed{0.5}`` matches ``1/2`` and ``\\frac{2}{4}``). A GSM8K-style ``#### 72``
  (in the completion or the reference) and an ``<answer>...</answer>`` span are cut out first,
  because math-verify would otherwise read the last number anywhere in the text.
- ``format``: 1.0 when the answer is stated in the expected form, else 0.0. The expected form is
  the record's ``answer_pattern`` regex matched against the whole stripped completion when the
  record has one (the arithmetic task: a bare integer), otherwise an explicit final-answer
  marker at the end of the completion (see :func:`ends_with_marked_answer`).
- ``code_tests``: 1.0 when the completion passes the record's unit tests, run in the sandbox
  of :mod:`logra_megatron.rl.sandbox`, else 0.0. The program is the completion (preceded by the
  prompt when ``metadata["include_prompt"]`` is true, as for HumanEval, whose completions
  continue the prompt's function), then ``metadata["test"]``, then ``check(<entry_point>)`` when
  ``metadata["entry_point"]`` is given (see :func:`code_tests_program`). A completion holding a
  Markdown code block (a chat model's reply) contributes the block's code instead.

Each reward says what it needs from a record (``register_reward(..., needs=...)``: a reference
answer, unit tests, a reasoning-gym task); :func:`check_reward_fits_task` refuses, when the config
is resolved, a ``--reward`` the task's records cannot serve (``--reward gsm_symbolic`` on the
arithmetic task). Without ``--reward`` the task decides (``TaskSource.default_reward``).

Rewards that misbehave (raise, hang, kill their process) are contained by
:class:`logra_megatron.rl.reward_runner.RewardRunner`, which the trainer calls them through.

Final-answer extraction (:func:`extract_final_answer`) tries, in order, and takes the LAST
occurrence of the first rule that matches: ``<answer>X</answer>``; ``\\boxed{X}`` (braces
balanced); ``#### X`` (to the end of its line); ``Answer: X`` / ``answer is X``
(case-insensitive, to the end of its line); finally the last number in the text. The result is
stripped of whitespace, surrounding ``$`` and ``*`` (Markdown bold) and a trailing period;
``None`` when nothing is found.
"""

import functools
import math
import re
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from logra_megatron.errors import UserError
from logra_megatron.rl.sandbox import SandboxLimits, SandboxResult, run_program
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, PROVIDES_TESTS
from logra_megatron.rl.tasks.reasoning_gym_source import REASONING_GYM, REASONING_GYM_TASKS, provides_key
from logra_megatron.registry import Registry
from logra_megatron.schema import option

RewardFn = Callable[[dict, str], float]


def _as_float_reward(fn: RewardFn) -> RewardFn:
    """``fn`` with a ``None`` completion read as empty text and its result a Python float."""

    @functools.wraps(fn)
    def reward(prompt_record: dict, completion_text: Optional[str]) -> float:
        return float(fn(prompt_record, completion_text if isinstance(completion_text, str) else ""))

    return reward


def _is_reward(obj) -> Optional[str]:
    if not callable(obj) or isinstance(obj, type):
        return "a reward is a function reward(prompt_record, completion_text) -> float"
    needs = getattr(obj, "needs", ())
    if not isinstance(needs, (tuple, list, frozenset, set)) or not all(isinstance(need, str) for need in needs):
        return "its 'needs' attribute must be a tuple of what it reads from a record (e.g. ('answer',))"
    return None


REWARDS = Registry("reward", "--reward", accepts=_is_reward, adapt=_as_float_reward, close_cutoff=0.75,
                   summary="a reasoning-gym dataset's name (its score_answer)")
"""Every reward by name (:func:`register_reward`), and outside code by ``package.module:fn``
(slime's ``--custom-rm-path``): ``fn(prompt_record, completion_text) -> float``, with an optional
``fn.needs`` tuple saying what it reads from a record (``("answer",)``; nothing by default)."""


def register_reward(name: str, needs: tuple = (), listed: bool = True, help: str = ""):
    """Decorator: register ``fn(prompt_record, completion_text) -> float`` under ``name``.

    ``needs``: what the reward reads from a record, among what task sources provide
    (``TaskSource.provides``: ``"answer"``, ``"tests"``, ``"reasoning_gym"``,
    ``"reasoning_gym:<dataset>"``); nothing by default. The registered function is wrapped so
    that a ``None`` completion counts as empty text and the result is always a Python float.
    ``listed``: named in ``--reward``'s help (the per-dataset reasoning-gym rewards are summarized),
    with ``help`` (default: the docstring's first line).
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        reward = _as_float_reward(fn)
        REWARDS.register(name, reward, needs=frozenset(needs), listed=listed, help=help)
        return reward

    return decorate


def available_rewards() -> list:
    """Names of the registered rewards, sorted."""
    return sorted(REWARDS)


def get_reward(name: str) -> RewardFn:
    """The reward registered under ``name``, or the outside function ``package.module:fn`` names;
    a one-line :class:`UserError` otherwise (unknown names listed, with close matches)."""
    return REWARDS.get(name)


def reward_needs(name: str) -> frozenset:
    """What the reward ``name`` reads from a record (see :func:`register_reward`)."""
    entry = REWARDS.entry(name)
    if entry.outside:
        return frozenset(getattr(entry.info["source"], "needs", ()))
    return entry.info["needs"]


def check_reward_fits_task(name: str, task_name: str, provides: frozenset) -> None:
    """A :class:`UserError` when the records of ``--task task_name`` (which provide
    ``provides``) lack what the reward ``name`` needs."""
    missing = reward_needs(name) - provides
    if not missing:
        return
    if any(need.startswith(REASONING_GYM) for need in missing):
        scored = "any reasoning-gym task" if REASONING_GYM in missing else f"reasoning-gym {name} problems"
        why = f"it scores {scored}"
    elif PROVIDES_TESTS in missing:
        why = "it runs each record's unit tests (metadata 'test'), which this task's records do not have"
    else:
        why = "it compares with a reference answer, which this task's records do not have"
    raise UserError(f"--reward {name} cannot score --task {task_name}: {why}; leave --reward out to use the "
                    f"task's own reward")


@dataclass(frozen=True)
class RewardConfig:
    """Which registered reward scores completions (training and evaluation)."""

    name: Optional[str] = option(None, flag="--reward",
                                 help=lambda: REWARDS.help("the reward (default: the task's own: arithmetic: "
                                                           "exact_match, reasoning-gym: its score_answer, jsonl: "
                                                           "final_answer, humaneval: code_tests)"))
    timeout_s: float = option(30.0, flag="--reward-timeout",
                              help="seconds one completion's reward may take; past it the reward scores 0 "
                                   "and is counted (reward_timeouts)")
    workers: int = option(1, flag="--reward-workers", help="processes that compute rewards in parallel")

    def __post_init__(self):
        if self.name is not None:
            get_reward(self.name)
        if not self.timeout_s > 0:
            raise UserError(f"--reward-timeout must be > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise UserError(f"--reward-workers must be >= 1, got {self.workers}")


def weighted_reward(weights: dict) -> RewardFn:
    """A reward that is the weighted sum of registered rewards, e.g.
    ``weighted_reward({"exact_match": 1.0, "format": 0.1})``."""
    parts = [(get_reward(name), float(weight)) for name, weight in weights.items()]

    def reward(prompt_record: dict, completion_text: str) -> float:
        return sum(weight * fn(prompt_record, completion_text) for fn, weight in parts)

    return reward


# --- final-answer extraction -------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_LINE = re.compile(r"\banswer(?:\s+is\s*:?|\s*:)[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None  # unbalanced: the completion was cut off inside the box


def _clean(answer: str) -> Optional[str]:
    decoration = " \t\r\n$*"  # whitespace, LaTeX dollars, Markdown bold
    answer = answer.strip(decoration)
    if answer.endswith("."):
        answer = answer[:-1].strip(decoration)
    return answer or None


def _marked_answer(text: str) -> Optional[str]:
    """The answer given with an explicit marker (rules 1-4), or None."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return _clean(tags[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    for pattern in (_HASHES, _ANSWER_LINE):
        found = pattern.findall(text)
        if found:
            return _clean(found[-1])
    return None


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer stated in ``text`` (rules in the module docstring), or ``None``."""
    if not text:
        return None
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def ends_with_marked_answer(text: str) -> bool:
    """True when ``text`` ends with an explicitly marked, non-empty final answer:
    ``<answer>X</answer>``, ``\\boxed{X}`` (optionally followed by ``$``, ``.`` or ``]``), or a
    last line holding ``#### X`` or ``Answer: X`` (e.g. ``Final answer: X``)."""
    tail = text.rstrip()
    if re.search(r"<answer>\s*\S.*?</answer>$", tail, re.DOTALL | re.IGNORECASE):
        return True
    box = max(tail.rfind("\\boxed{"), tail.rfind("\\fbox{"))
    if box >= 0:
        content = _last_boxed(tail)
        if content and content.strip():
            closing = box + tail[box:].index("{") + 1 + len(content)
            if re.fullmatch(r"[}\s$.\\\]]*", tail[closing:]):
                return True
    last_line = tail.rsplit("\n", 1)[-1]
    return bool(re.search(r"(?:####|\banswer\s*:)[\s*]*[^\s*]", last_line, re.IGNORECASE))


# --- rewards -----------------------------------------------------------------------------------

@register_reward("exact_match", needs=(PROVIDES_ANSWER,), help="the stripped completion is the reference")
def exact_match_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the stripped completion equals the stripped reference answer."""
    return 1.0 if completion_text.strip() == str(prompt_record["answer"]).strip() else 0.0


@register_reward("arithmetic_partial", needs=(PROVIDES_ANSWER,),
                 help="exact 1.0, half credit per right digit of a same-length number")
def arithmetic_partial_reward(prompt_record: dict, completion_text: str) -> float:
    """Exact answer: 1.0. A number with the right length: half credit per matching digit
    (right-aligned) -- a denser signal than exact match for a policy that is often nearly right.
    Anything else: 0.0. Accuracy is still measured by exact match."""
    answer, text = str(prompt_record["answer"]).strip(), completion_text.strip()
    if text == answer:
        return 1.0
    if not re.fullmatch(r"-?\d+", text) or len(text) != len(answer):
        return 0.0
    matches = sum(a == b for a, b in zip(text, answer))
    return 0.5 * matches / len(answer)


@register_reward("format", help="the answer is stated in the expected form")
def format_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the completion states its answer in the expected form (module docstring)."""
    pattern = prompt_record.get("answer_pattern")
    if pattern is not None:
        return 1.0 if re.fullmatch(pattern, completion_text.strip()) else 0.0
    return 1.0 if ends_with_marked_answer(completion_text) else 0.0


def _as_number(text: str) -> Optional[float]:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(stated: Optional[str], reference: str) -> bool:
    """Whether a stated final answer equals the reference: the same text once both are cleaned
    (whitespace, ``$``, ``*``, a final period), or the same number (``1,000`` = ``1000.0``)."""
    if stated is None:
        return False
    stated, reference = _clean(stated) or "", _clean(str(reference)) or ""
    if stated == reference:
        return True
    stated_number, reference_number = _as_number(stated), _as_number(reference)
    return stated_number is not None and stated_number == reference_number


@register_reward("final_answer", needs=(PROVIDES_ANSWER,),
                 help="the stated final answer equals the reference, as text or number")
def final_answer_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the completion's stated final answer equals the reference (:func:`same_answer`)."""
    return 1.0 if same_answer(extract_final_answer(completion_text), prompt_record["answer"]) else 0.0


@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(task_name: str):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task_name not in DATASETS:
        raise UserError(f"prompt record names task {task_name!r}, which reasoning-gym does not know")
    return reasoning_gym.get_score_answer_fn(task_name)


def score_with_reasoning_gym(task_name: str, prompt_record: dict, completion_text: str) -> float:
    """Extract the final answer and score it with reasoning-gym's ``score_answer`` for the task."""
    answer = extract_final_answer(completion_text)
    if answer is None:
        return 0.0
    reference = prompt_record.get("answer")
    entry = {
        "question": prompt_record.get("prompt", ""),
        "answer": None if reference is None else str(reference),  # None: scored from the metadata
        "metadata": prompt_record.get("metadata", {}),
    }
    return float(_reasoning_gym_scorer(task_name)(answer, entry))


def _register_reasoning_gym_reward(task_name: str) -> None:
    @register_reward(task_name, needs=(provides_key(task_name),), listed=False)
    def reward(prompt_record: dict, completion_text: str) -> float:
        return score_with_reasoning_gym(task_name, prompt_record, completion_text)

    reward.__doc__ = f"reasoning-gym's {task_name} score of the extracted final answer."


for _task in REASONING_GYM_TASKS:
    _register_reasoning_gym_reward(_task)


@register_reward(REASONING_GYM, needs=(REASONING_GYM,), help="reasoning-gym's score for the record's own dataset")
def reasoning_gym_reward(prompt_record: dict, completion_text: str) -> float:
    """reasoning-gym score for the dataset named by ``prompt_record["task"]`` (mixed task sets)."""
    return score_with_reasoning_gym(prompt_record["task"], prompt_record, completion_text)


def _strip_for_math_verify(text: str) -> str:
    """Cut out an ``<answer>`` span or a GSM8K ``#### X`` before math-verify reads the text."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    return text


@register_reward("math_verify", needs=(PROVIDES_ANSWER,), help="symbolic equivalence with math-verify")
def math_verify_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when math-verify finds the completion's answer equivalent to the reference.

    math-verify bounds its parse and compare with ``signal.alarm``, which only works in the
    main thread; elsewhere the bound is dropped rather than failing.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    predicted_text = _strip_for_math_verify(completion_text)
    if not predicted_text.strip():
        return 0.0
    reference_text = _strip_for_math_verify(str(prompt_record["answer"]))
    gold = parse(reference_text, parsing_timeout=timeout)
    if not gold:
        gold = parse(f"${reference_text}$", parsing_timeout=timeout)
    predicted = parse(predicted_text, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


# --- code execution ----------------------------------------------------------------------------

CODE_TEST_LIMITS = SandboxLimits()
"""Limits of one ``code_tests`` run (10 s wall, 5 s CPU, 512 MiB: module sandbox)."""


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def code_block(text: str, entry_point: Optional[str] = None) -> Optional[str]:
    """The code of a Markdown code block in ``text``: the first block that defines
    ``entry_point``, else the last block (a block cut off by the length limit counts up to the
    end); None when ``text`` has no fenced block (a bare continuation of the prompt)."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    if entry_point:
        defining = [block for block in blocks if re.search(rf"^\s*(?:async\s+)?def\s+{entry_point}\s*\(", block, re.M)]
        if defining:
            return defining[0]
    return blocks[-1]


def code_tests_program(prompt_record: dict, completion_text: str) -> str:
    """The program ``code_tests`` runs: ``[prompt +] completion``, the record's tests, the check call.

    A HumanEval record: ``prompt`` is the function's signature and docstring, the completion its
    body, and ``metadata`` holds ``test`` (``def check(candidate): assert candidate(2, 3) == 5
    ...``), ``entry_point`` (``"add"``) and ``include_prompt=True``. An optional
    ``metadata["stdin"]`` is the program's standard input. A completion holding a Markdown code
    block (a chat model asked for the whole function) contributes that block's code
    (:func:`code_block`) on a line of its own after the prompt, so it may redefine the function
    and still use the prompt's imports.
    """
    metadata = prompt_record.get("metadata") or {}
    test = metadata.get("test")
    if not isinstance(test, str) or not test.strip():
        raise UserError("code_tests reward: the prompt record has no metadata['test'] (the unit tests to run)")
    entry_point = metadata.get("entry_point")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise UserError(f"code_tests reward: metadata['entry_point'] must be a function name, got {entry_point!r}")
    prefix = str(prompt_record.get("prompt", "")) if metadata.get("include_prompt") else ""
    block = code_block(completion_text, entry_point)
    program = prefix + completion_text if block is None else prefix + "\n" + block
    program += "\n\n" + test + "\n"
    if entry_point:
        program += f"\n\ncheck({entry_point})\n"
    return program


def run_code_tests(prompt_record: dict, completion_text: str,
                   limits: SandboxLimits = CODE_TEST_LIMITS) -> SandboxResult:
    """Run :func:`code_tests_program` in the sandbox; the result says why it failed, if it did."""
    stdin = (prompt_record.get("metadata") or {}).get("stdin", "")
    return run_program(code_tests_program(prompt_record, completion_text), stdin=stdin, limits=limits)


@register_reward("code_tests", needs=(PROVIDES_TESTS,),
                 help="the completion passes the record's unit tests in the sandbox")
def code_tests_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the completion passes the record's unit tests in the sandbox, else 0.0."""
    return 1.0 if run_code_tests(prompt_record, completion_text).passed else 0.0


# --- rewards that misbehave --------------------------------------------------------------------
