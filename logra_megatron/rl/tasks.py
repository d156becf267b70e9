"""Prompt sources for RL: a tiny arithmetic task and offline reasoning-gym tasks.

Every task yields *prompt records*, plain dicts that the rollout and reward code pass around::

    {"prompt": "12+7=", "answer": "19", "task": "arithmetic", "metadata": {...}}

``prompt`` is the text the policy continues, ``answer`` the reference the reward compares
against, ``task`` the generator's name, ``metadata`` whatever the generator knows about the
problem (reasoning-gym's ``score_answer`` reads it). A record may also carry ``answer_pattern``,
a regular expression the whole (stripped) completion must match to count as well formatted
(see the ``format`` reward).

The arithmetic task is the embedded default: it must be learnable by a ~180k-parameter model
with a character-level tokenizer in minutes on a CPU, so prompts are short (``"12+7="``) and
the answer is the bare integer. Choices:

- **Held-out split by hashing, not by enumeration.** A problem is held out when a hash of
  ``(split_seed, prompt)`` falls below ``held_out_fraction``. Membership is a pure function of
  the prompt, so training sampling can reject held-out problems for any operand range (no
  table of all problems), and the split does not move when the training ``seed`` changes.
- **Training batches are a function of (seed, step).** ``train_prompts(n, step)`` draws from a
  generator seeded by both, so a resumed run sees the same prompts it would have seen, and two
  data-parallel ranks can each draw their own share by passing distinct steps or offsets.
- **Subtraction stays non-negative by default** (operands ordered larger first), which keeps
  answers and the vocabulary a model must learn small; ``allow_negative`` lifts it.

reasoning-gym tasks (``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic``, ...) are generated
offline from a seed by :func:`make_tasks`; reasoning-gym is imported lazily (it takes seconds).
"""

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.schema import option

ARITHMETIC_TASK = "arithmetic"
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """The embedded arithmetic task. Validated on construction."""

    min_operand: int = 0
    """Smallest operand (inclusive). Negative operands are allowed but make prompts longer."""
    max_operand: int = option(19, help="the arithmetic task's largest operand (operands 0..N); 99 gives "
                              "2-digit problems such as 12+7=")
    operations: tuple = ("+", "-")
    """Operators to draw from, any of ``+``, ``-``, ``*``."""
    allow_negative: bool = False
    """Allow negative results of subtraction; when False the larger operand comes first."""
    held_out_fraction: float = option(0.3, help="share of the arithmetic problems held out for evaluation "
                                      "(never trained on)")
    split_seed: int = 0
    """Seeds the train/held-out partition (independent of ``seed`` so the split is stable)."""
    seed: int = 0
    """Seeds the training prompt stream (the trainer sets it from ``--seed``)."""

    def __post_init__(self):
        object.__setattr__(self, "operations", tuple(self.operations))
        if self.max_operand < 1:
            raise UserError(f"--max-operand must be >= 1, got {self.max_operand}")
        if self.min_operand > self.max_operand:
            raise UserError(
                f"arithmetic min_operand ({self.min_operand}) is larger than max_operand "
                f"({self.max_operand})"
            )
        if not self.operations:
            raise UserError("arithmetic task needs at least one operation")
        unknown = [op for op in self.operations if op not in _OPERATIONS]
        if unknown:
            raise UserError(
                f"unknown arithmetic operation(s) {unknown}; choose from {sorted(_OPERATIONS)}"
            )
        if not 0.0 < self.held_out_fraction < 1.0:
            raise UserError(
                f"--held-out-fraction must be strictly between 0 and 1, got {self.held_out_fraction}"
            )

    @property
    def num_problems(self) -> int:
        """Upper bound on distinct problems (exact when ``allow_negative`` or no ``-``)."""
        width = self.max_operand - self.min_operand + 1
        return width * width * len(self.operations)


class ArithmeticTasks:
    """Seeded generator of ``a<op>b=`` problems with a disjoint held-out split."""

    def __init__(self, config: Optional[ArithmeticTaskConfig] = None):
        self.config = config or ArithmeticTaskConfig()

    def record(self, a: int, op: str, b: int) -> dict:
        """The prompt record of one problem (operands taken as given)."""
        return {
            "prompt": f"{a}{op}{b}=",
            "answer": str(_OPERATIONS[op](a, b)),
            "task": ARITHMETIC_TASK,
            "metadata": {"a": a, "op": op, "b": b},
            "answer_pattern": r"-?\d+",
        }

    def is_held_out(self, prompt: str) -> bool:
        """Whether a prompt belongs to the held-out split (a pure function of the prompt)."""
        digest = hashlib.sha256(f"{self.config.split_seed}|{prompt}".encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.config.held_out_fraction * 2.0**64

    def _random_problem(self, rng: random.Random) -> dict:
        cfg = self.config
        a = rng.randint(cfg.min_operand, cfg.max_operand)
        b = rng.randint(cfg.min_operand, cfg.max_operand)
        op = rng.choice(cfg.operations)
        if op == "-" and not cfg.allow_negative and a < b:
            a, b = b, a
        return self.record(a, op, b)

    def _draw(self, rng: random.Random, count: int, held_out: bool, what: str) -> list:
        """``count`` distinct problems from one side of the split, by rejection sampling."""
        chosen, seen = [], set()
        attempts_left = 200 * count + 10_000
        while len(chosen) < count and attempts_left > 0:
            attempts_left -= 1
            problem = self._random_problem(rng)
            prompt = problem["prompt"]
            if prompt in seen or self.is_held_out(prompt) != held_out:
                continue
            seen.add(prompt)
            chosen.append(problem)
        if len(chosen) < count:
            raise UserError(
                f"could only find {len(chosen)} distinct {what} arithmetic problems of the "
                f"{count} asked for; widen the operand range or change held_out_fraction"
            )
        return chosen

    def train_prompts(self, count: int, step: int = 0) -> list:
        """``count`` distinct training problems (never held out) for training step ``step``.

        Deterministic in ``(config.seed, step)``.
        """
        rng = random.Random(f"train|{self.config.seed}|{step}")
        return self._draw(rng, count, held_out=False, what="training")

    def held_out(self, count: int) -> list:
        """The first ``count`` problems of the held-out split (the same on every call)."""
        rng = random.Random(f"held-out|{self.config.split_seed}")
        return self._draw(rng, count, held_out=True, what="held-out")

    def text_samples(self, count: int) -> list:
        """``prompt + answer`` strings of training problems (tokenizer training text)."""
        return [p["prompt"] + p["answer"] for p in self.train_prompts(count, step=-1)]

    def settings(self) -> dict:
        """The config as a plain dict (for hashing and logging)."""
        return asdict(self.config)


TOKENIZER_CORPUS_TASK = ArithmeticTaskConfig(max_operand=99, held_out_fraction=0.1)
"""The text the embedded character-level tokenizer is trained on: 2-digit arithmetic, whose
characters cover every smaller operand range, so token ids do not depend on ``--max-operand``."""
TOKENIZER_CORPUS_SAMPLES = 2000


def tokenizer_corpus() -> list:
    """Training text of the embedded tokenizer (``prompt + answer`` lines)."""
    return ArithmeticTasks(TOKENIZER_CORPUS_TASK).text_samples(TOKENIZER_CORPUS_SAMPLES)


def make_tasks(task_name: str, n: int, seed: int, **task_kwargs) -> list:
    """``n`` prompt records of a task, generated offline and deterministically from ``seed``.

    ``task_name`` is ``"arithmetic"`` (``task_kwargs`` are :class:`ArithmeticTaskConfig`
    fields; training-split problems are returned) or any reasoning-gym dataset name such as
    ``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic`` (``task_kwargs`` go to that
    dataset's config, e.g. ``min_terms=2, max_terms=3``). Two different seeds of a
    reasoning-gym task may repeat a question when its problem space is small.
    """
    if n < 0:
        raise UserError(f"number of tasks must be >= 0, got {n}")
    if task_name == ARITHMETIC_TASK:
        try:
            config = ArithmeticTaskConfig(seed=seed, **task_kwargs)
        except TypeError as error:
            raise UserError(f"bad option for the arithmetic task: {error}") from None
        return ArithmeticTasks(config).train_prompts(n) if n else []
    return _reasoning_gym_tasks(task_name, n, seed, task_kwargs)


def _reasoning_gym_tasks(task_name: str, n: int, seed: int, task_kwargs: dict) -> list:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task_name not in DATASETS:
        raise UserError(
            f"unknown task {task_name!r}; use {ARITHMETIC_TASK!r} or a reasoning-gym dataset "
            f"such as basic_arithmetic, chain_sum, gsm_symbolic "
            f"({len(DATASETS)} are registered in reasoning_gym.factory.DATASETS)"
        )
    if n == 0:
        return []
    try:
        dataset = reasoning_gym.create_dataset(task_name, size=n, seed=seed, **task_kwargs)
    except (TypeError, ValueError, AssertionError) as error:
        raise UserError(f"bad options {task_kwargs} for reasoning-gym task {task_name!r}: {error}") from None
    return [
        {"prompt": entry["question"], "answer": entry["answer"], "task": task_name,
         "metadata": entry["metadata"]}
        for entry in dataset
    ]
