"""A task source over a fixed list of records (a JSONL file, the HumanEval problems).

Duplicated problem texts are kept once (the first). The split is the hash of the problem text
(tasks/split.py); the held-out set is the held-out records in list order, and a training batch is
a sample without replacement from the training records, drawn by a generator seeded by
``(seed, step)``.
"""

import random

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.base import TaskSource
from logra_megatron.rl.tasks.split import in_held_out_split


class FiniteTasks(TaskSource):
    """Subclasses set ``name`` and pass their records; see the module docstring."""

    def __init__(self, records: list, held_out_fraction: float, split_seed: int = 0, seed: int = 0):
        self.held_out_fraction, self.split_seed, self.seed = held_out_fraction, split_seed, seed
        unique, seen = [], set()
        for record in records:
            if record["prompt"] not in seen:
                seen.add(record["prompt"])
                unique.append(record)
        self.records = unique
        self._held_out = [r for r in unique if self.is_held_out(r["prompt"])]
        self._train = [r for r in unique if not self.is_held_out(r["prompt"])]

    def is_held_out(self, prompt: str) -> bool:
        return in_held_out_split(prompt, self.held_out_fraction, self.split_seed)

    def _too_few(self, what: str, count: int, side: str, have: int) -> UserError:
        return UserError(f"{what} asks for {count} distinct {side} problems, but {self.name} has only {have} "
                         f"({len(self.records)} problems, --held-out-fraction {self.held_out_fraction}); "
                         f"ask for fewer")

    def held_out(self, count: int) -> list:
        if count > len(self._held_out):
            raise self._too_few("--eval-prompts", count, "held-out", len(self._held_out))
        return self._held_out[:count]

    def train_prompts(self, count: int, step: int = 0) -> list:
        if count > len(self._train):
            raise self._too_few("--prompts-per-step", count, "training", len(self._train))
        return random.Random(f"train|{self.seed}|{step}").sample(self._train, count)

    def check_supply(self, needs: list) -> None:
        have = {"held-out": len(self._held_out), "training": len(self._train)}
        for side, what, count in needs:
            if count > have[side]:
                raise self._too_few(what, count, side, have[side])

    def length_probe(self, eval_count: int, batch: int) -> list:
        return self.records  # all of them: any may be drawn
