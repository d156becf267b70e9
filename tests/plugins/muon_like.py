"""A sketch-space update rule OUTSIDE the logra_megatron package, with memory of its own: Muon's
orthogonalised momentum, applied to each weight's sketch (tests/test_outside_update_rule.py puts
this directory on PYTHONPATH)::

    python -m logra_megatron.train --logra-update muon_like:MuonLike
    python tools/plan_memory.py --preset tiny --optimizer logra --logra-update muon_like:MuonLike

The rule declares what it holds (one fp32 momentum per sketch element: half of sketch-space
Adam's state) and what its step allocates, so the planner counts it without knowing its name.
It appends one JSON line per step to ``$MUON_LIKE_LOG`` so a test can see that it ran.
"""

import json
import os
from dataclasses import dataclass

import torch

from logra_megatron import parallel
from logra_megatron.logra.sketch import LEFT
from logra_megatron.logra.update_rules import ELEMENT, RANGE_FINDER

LOG_ENV = "MUON_LIKE_LOG"
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients of Muon (Keller Jordan, 2024): they push every singular
value of a matrix of spectral norm <= 1 towards 1 in a few steps."""
FP32 = 4


@dataclass(frozen=True)
class MuonLikeOptions:
    """``--logra-update-options`` of this rule."""

    steps: int = 5
    """Newton-Schulz iterations per weight and step."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def orthogonalised(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """``U V^T`` of ``matrix = U S V^T``, approximately (Newton-Schulz on the normalised matrix),
    as a new tensor; the iteration runs on the short side's Gram matrix (``k x k``)."""
    wide = matrix.shape[0] <= matrix.shape[1]
    x = matrix if wide else matrix.t()
    x = x / (x.norm() + 1e-7)
    a, b, c = NEWTON_SCHULZ
    for _ in range(steps):
        gram = x @ x.t()
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x if wide else x.t()


class MuonLike:
    """Muon in sketch space: a momentum per sketch element; each weight's update is its
    momentum orthogonalised, scaled by ``sqrt(max(1, rows / cols))`` as Muon scales a matrix."""

    state_names = ("momentum",)
    state_layout = ELEMENT
    projections = RANGE_FINDER
    kl_max_scale = 1.0
    options = MuonLikeOptions

    @classmethod
    def state_bytes(cls, slice_numel: int, line_numel: int) -> int:
        """One fp32 momentum per element of the slice (the whole buffer: no ZeRO-1)."""
        return slice_numel * FP32

    @classmethod
    def update_temporaries(cls, slice_numel: int, line_numel: int):
        """``U`` is allocated first and each weight's iteration then holds at most two copies of
        its sketch and two ``k x k`` Gram products (``k^2 <=`` the sketch's elements): four
        sketches' worth of one weight, bounded here by the whole slice, plus ``U``'s own bytes,
        since ``U`` already exists while they live."""
        return 5 * slice_numel * FP32, 0

    def __init__(self, buffer, optimizer_config, logra_config, options: MuonLikeOptions):
        # A weight's whole sketch is orthogonalised: a ZeRO-1 slice or a TP shard would cut it.
        if buffer.zero1:
            raise ValueError("MuonLike orthogonalises whole sketches and does not support ZeRO-1 slices")
        if parallel.tp_size() > 1:
            raise ValueError("MuonLike orthogonalises whole sketches and does not support TP > 1")
        self.buffer = buffer
        self.steps = options.steps
        self.beta = optimizer_config.adam_beta1
        self.momentum = buffer.flat.new_zeros(buffer.slice_numel, dtype=torch.float32)

    @torch.no_grad()
    def update(self, grad, lr, weight_decay, step):
        self.momentum.mul_(self.beta).add_(grad, alpha=1 - self.beta)
        update = torch.empty_like(grad)
        for entry in self.buffer.weights:
            momentum = entry.view(self.momentum)
            rows, cols = momentum.shape
            entry.view(update).copy_(orthogonalised(momentum, self.steps)).mul_(max(1.0, rows / cols) ** 0.5)
        _log(event="update", step=step, grad_norm=float(grad.norm()), update_norm=float(update.norm()))
        return update

    def state(self):
        return {"momentum": self.momentum}

    def rotate(self, state, change, side):
        momentum = state["momentum"]
        momentum.copy_(change @ momentum if side == LEFT else momentum @ change.t())

    def after_refresh(self, state):
        pass

    def reset(self):
        self.momentum.zero_()

    def counters(self):
        return {}

    def load_counters(self, counters):
        pass


def _log(**row) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
