"""The embedded default task: ``a<op>b=`` arithmetic with a bare integer answer.

It must be learnable by a ~180k-parameter model with a character-level tokenizer in minutes on
a CPU, so prompts are short (``"12+7="``) and the answer is the bare integer. Choices:

- **Held-out split by hashing, not by enumeration** (tasks/split.py): training sampling rejects
  held-out problems for any operand range, and the split does not move when ``seed`` changes.
- **Training batches are a function of (seed, step).** ``train_prompts(n, step)`` draws from a
  generator seeded by both, so a resumed run sees the same prompts it would have seen.
- **Subtraction stays non-negative by default** (operands ordered larger first), which keeps
  answers and the vocabulary a model must learn small; ``allow_negative`` lifts it.
"""

import random
from dataclasses import asdict, dataclass
from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, TaskSource
from logra_megatron.rl.tasks.split import in_held_out_split

ARITHMETIC_TASK = "arithmetic"
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SUPPLY_COUNTED_UP_TO = 100_000
"""check_supply counts the problems on each side of the split exactly when there are at most
this many (a few ms); above, a run asks for far fewer than exist."""


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """The embedded arithmetic task. Validated on construction."""

    min_operand: int = 0
    """Smallest operand (inclusive). Negative operands are allowed but make prompts longer."""
    max_operand: int = 19
    """Largest operand (``--max-operand``)."""
    operations: tuple = ("+", "-")
    """Operators to draw from, any of ``+``, ``-``, ``*``."""
    allow_negative: bool = False
    """Allow negative results of subtraction; when False the larger operand comes first."""
    held_out_fraction: float = 0.3
    """Share of the problems held out for evaluation (``--held-out-fraction``)."""
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


class ArithmeticTasks(TaskSource):
    """Seeded generator of ``a<op>b=`` problems with a disjoint held-out split."""

    name = ARITHMETIC_TASK

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
        return in_held_out_split(prompt, self.config.held_out_fraction, self.config.split_seed)

    def default_reward(self, chat: bool) -> str:
        # Bare prompts: the completion is the number and must stop there. In chat form the model
        # states its answer in \boxed{} after whatever it writes first.
        return "final_answer" if chat else "exact_match"

    @property
    def provides(self) -> frozenset:
        return frozenset({PROVIDES_ANSWER})

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

    def all_prompts(self) -> set:
        """Every distinct problem text of the configured range."""
        cfg, prompts = self.config, set()
        for a in range(cfg.min_operand, cfg.max_operand + 1):
            for b in range(cfg.min_operand, cfg.max_operand + 1):
                for op in cfg.operations:
                    first, second = (b, a) if op == "-" and not cfg.allow_negative and a < b else (a, b)
                    prompts.add(self.record(first, op, second)["prompt"])
        return prompts

    def check_supply(self, needs: list) -> None:
        """Counted exactly (not by sampling) for ranges of up to :data:`SUPPLY_COUNTED_UP_TO`
        problems, so the message can say how many there are."""
        cfg = self.config
        if cfg.num_problems > SUPPLY_COUNTED_UP_TO:
            have = {"held-out": cfg.num_problems, "training": cfg.num_problems}  # upper bounds
        else:
            prompts = self.all_prompts()
            held_out = sum(self.is_held_out(prompt) for prompt in prompts)
            have = {"held-out": held_out, "training": len(prompts) - held_out}
        for side, what, count in needs:
            if count > have[side]:
                raise UserError(
                    f"{what} asks for {count} distinct {side} problems, but the arithmetic task has only "
                    f"{have[side]} (--max-operand {cfg.max_operand}, --held-out-fraction "
                    f"{cfg.held_out_fraction}); ask for fewer or raise --max-operand")

    def length_probe(self, eval_count: int, batch: int) -> list:
        """The widest problems: every operation on the extreme operands."""
        cfg = self.config
        extremes = (cfg.min_operand, cfg.max_operand)
        return [self.record(a, op, b) for a in extremes for b in extremes for op in cfg.operations]


TOKENIZER_CORPUS_TASK = ArithmeticTaskConfig(max_operand=99, held_out_fraction=0.1)
"""The text the embedded character-level tokenizer is trained on: 2-digit arithmetic, whose
characters cover every smaller operand range, so token ids do not depend on ``--max-operand``."""
TOKENIZER_CORPUS_SAMPLES = 2000


def tokenizer_corpus() -> list:
    """Training text of the embedded tokenizer (``prompt + answer`` lines)."""
    return ArithmeticTasks(TOKENIZER_CORPUS_TASK).text_samples(TOKENIZER_CORPUS_SAMPLES)
