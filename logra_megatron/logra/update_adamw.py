"""Sketch-space AdamW: torch's AdamW arithmetic on this rank's slice of the flat sketch gradient.

With the identity projection at full rank it *is* dense Adam (tests/test_logra_training.py).
Moments follow a refresh into the new basis: the first moment by the change of basis ``C``, the
second by ``C o C`` (``second_moment="rotate"``, how a variance transforms; it stays
non-negative) or restarted with its bias correction (``"reset"``) (docs/ALGORITHM.md,
"Sketch-space Adam" and "Refresh"). Implements the interface in
:mod:`logra_megatron.logra.update_rules`.
"""

import math
from typing import Dict

import torch

from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch import LEFT
from logra_megatron.logra.update_memory import SketchAdamWMemory


class SketchAdamW(SketchAdamWMemory):
    """Adam moments ``exp_avg`` / ``exp_avg_sq`` over ``numel`` sketch-space elements.

    The first moment's bias correction counts optimizer steps (``step``); the second moment's
    counts its own steps, which restart when ``second_moment="reset"`` drops it at a refresh.
    Decoupled weight decay is applied to the weights by the optimizer, as in torch's AdamW.
    Its state names, layout, projections and memory are declared, torch-free, by
    :class:`~logra_megatron.logra.update_memory.SketchAdamWMemory`.
    """

    kl_max_scale = 1.0

    def __init__(self, buffer, optimizer_config, logra_config: LogRAConfig):
        numel = buffer.slice_numel
        self.beta1 = optimizer_config.adam_beta1
        self.beta2 = optimizer_config.adam_beta2
        self.eps = optimizer_config.adam_eps
        self.second_moment = logra_config.second_moment
        self.exp_avg = buffer.flat.new_zeros(numel, dtype=torch.float32)
        self.exp_avg_sq = buffer.flat.new_zeros(numel, dtype=torch.float32)
        self.second_moment_steps = 0

    def update(self, grad: torch.Tensor, lr: float, weight_decay: float, step: int) -> torch.Tensor:
        """The AdamW direction ``m_hat / (sqrt(v_hat) + eps)``; ``lr`` and ``weight_decay``
        are applied by the optimizer."""
        beta1, beta2, eps = self.beta1, self.beta2, self.eps
        self.second_moment_steps += 1
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**self.second_moment_steps
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        return (self.exp_avg / denom).div_(bias_correction1)

    def state(self) -> Dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def rotate(self, state: Dict[str, torch.Tensor], change: torch.Tensor, side: str) -> None:
        first, second = state["exp_avg"], state["exp_avg_sq"]
        # The second moment follows the same change of basis as a variance does: squared
        # coefficients (C o C), which keeps it non-negative and on the first moment's scale.
        if side == LEFT:  # moments are r x n: M <- C M
            first.copy_(change @ first)
            if self.second_moment == "rotate":
                second.copy_(change.square() @ second)
        else:  # moments are m x r: M <- M C^T
            first.copy_(first @ change.t())
            if self.second_moment == "rotate":
                second.copy_(second @ change.square().t())

    def after_refresh(self, state: Dict[str, torch.Tensor]) -> None:
        if self.second_moment == "reset":
            state["exp_avg_sq"].zero_()
            self.second_moment_steps = 0

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.second_moment_steps = 0

    def counters(self) -> Dict[str, int]:
        return {"second_moment_steps": self.second_moment_steps}

    def load_counters(self, counters: Dict[str, int]) -> None:
        self.second_moment_steps = int(counters["second_moment_steps"])
