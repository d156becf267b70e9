"""A plug-in module OUTSIDE the logra_megatron package: a task, a reward and a sketch-space update
rule, each chosen by flag only (tests/test_plugins.py puts this directory on PYTHONPATH)::

    python -m logra_megatron.train --task three_terms:ThreeTerms --task-options '{"terms": 3}' \\
        --reward three_terms:offset_reward --logra-update three_terms:SignMomentum \\
        --logra-update-options '{"scale": 0.5}'

Each leaves a trace the test reads: the task's records carry ``task: three_terms`` and their term
count, the reward's values are offset by 1/8 (an in-package reward never gives 0.125 to a wrong
answer), and the update rule appends one JSON line per step to ``$THREE_TERMS_LOG``.
"""

import json
import os
import random
from dataclasses import dataclass

import torch

from logra_megatron.errors import UserError
from logra_megatron.logra.sketch import LEFT
from logra_megatron.logra.update_rules import ELEMENT, RANGE_FINDER
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, TaskSource
from logra_megatron.rl.tasks.split import in_held_out_split

LOG_ENV = "THREE_TERMS_LOG"


def _log(**row) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


# --- the task ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ThreeTermsOptions:
    """``--task-options`` of this task."""

    terms: int = 2
    max_operand: int = 9

    def __post_init__(self):
        if self.terms < 2:
            raise ValueError(f"terms must be >= 2, got {self.terms}")


class ThreeTerms(TaskSource):
    """Sums of ``terms`` one-digit numbers, ``3+4+1=`` for 3 (characters the embedded tokenizer knows)."""

    name = "three_terms"
    options = ThreeTermsOptions

    def __init__(self, config, options: ThreeTermsOptions):
        self.options_used = options
        self.fraction, self.split_seed, self.seed = config.held_out_fraction, config.split_seed, config.seed
        _log(event="task", terms=options.terms)

    def record(self, numbers) -> dict:
        return {"prompt": "+".join(map(str, numbers)) + "=", "answer": str(sum(numbers)), "task": self.name,
                "metadata": {"terms": len(numbers)}}

    def _draw(self, rng, count, held_out):
        chosen, seen = [], set()
        for _ in range(100 * count + 1000):
            if len(chosen) == count:
                break
            problem = self.record([rng.randint(0, self.options_used.max_operand)
                                   for _ in range(self.options_used.terms)])
            if problem["prompt"] not in seen and self.is_held_out(problem["prompt"]) == held_out:
                seen.add(problem["prompt"])
                chosen.append(problem)
        if len(chosen) < count:
            raise UserError(f"three_terms: only {len(chosen)} distinct problems of the {count} asked for")
        return chosen

    def train_prompts(self, count, step=0):
        return self._draw(random.Random(f"train|{self.seed}|{step}"), count, held_out=False)

    def held_out(self, count):
        return self._draw(random.Random(f"held-out|{self.split_seed}"), count, held_out=True)

    def is_held_out(self, prompt):
        return in_held_out_split(prompt, self.fraction, self.split_seed)

    def default_reward(self, chat):
        return "exact_match"

    @property
    def provides(self):
        return frozenset({PROVIDES_ANSWER})


# --- the reward --------------------------------------------------------------------------------

def offset_reward(prompt_record, completion_text):
    """1/8, plus 1/2 for the right sum, plus 1/4 for starting with a digit; -1 for a record of another task."""
    if prompt_record.get("task") != "three_terms" or prompt_record["metadata"]["terms"] != 3:
        return -1.0
    text = completion_text.strip()
    return 0.125 + 0.5 * (text == prompt_record["answer"]) + 0.25 * text[:1].isdigit()


offset_reward.needs = (PROVIDES_ANSWER,)


# --- the update rule ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SignMomentumOptions:
    """``--logra-update-options`` of this rule."""

    scale: float = 1.0


class SignMomentum:
    """Signum in sketch space: a momentum per sketch element, the update its sign times ``scale``."""

    state_names = ("momentum",)
    state_layout = ELEMENT
    projections = RANGE_FINDER
    kl_max_scale = 1.0
    options = SignMomentumOptions

    def __init__(self, buffer, optimizer_config, logra_config, options: SignMomentumOptions):
        self.scale = options.scale
        self.beta = optimizer_config.adam_beta1
        self.momentum = buffer.flat.new_zeros(buffer.slice_numel, dtype=torch.float32)
        self.sign_steps = 0

    def update(self, grad, lr, weight_decay, step):
        self.sign_steps += 1
        self.momentum.mul_(self.beta).add_(grad, alpha=1 - self.beta)
        _log(event="update", step=step, sign_steps=self.sign_steps, grad_norm=float(grad.norm()),
             numel=grad.numel(), scale=self.scale)
        return torch.sign(self.momentum).mul_(self.scale)

    def state(self):
        return {"momentum": self.momentum}

    def rotate(self, state, change, side):
        momentum = state["momentum"]
        momentum.copy_(change @ momentum if side == LEFT else momentum @ change.t())

    def after_refresh(self, state):
        pass

    def reset(self):
        self.momentum.zero_()
        self.sign_steps = 0

    def counters(self):
        return {"sign_steps": self.sign_steps}

    def load_counters(self, counters):
        self.sign_steps = int(counters["sign_steps"])


NOT_A_RULE = 42
"""For the test of a path to something that is not an update rule."""
