"""RowAdam: the reference implementation's update rule, as ``--logra-update rowadam``
(/work/shared/DESIGN.md section 3b; docs/ALGORITHM.md, "RowAdam").

Every step sketches through a fresh Rademacher projection (``A``, signs / sqrt(r); drawn by
:class:`~logra_megatron.logra.refresh.RademacherRedraw`), so a value stored per sketch element
would describe a different direction at every step. The only state is therefore one second
moment per *line* of a weight's sketch: a line the projection does not mix, which keeps its
meaning from step to step. For a right sketch ``S = G A^T`` (``m x r``, column-parallel weights,
the reference's only kind) a line is an output row of ``W``; for a left sketch ``S = A G``
(``r x n``, row-parallel weights) it is an input column, since there the projection mixes the
output rows. Per weight and step ``t``:

    v     <- b2 v + (1 - b2) mean_line(S^2)          (b2 = 0.95; mean over the r sketch entries)
    c     =  1 / (sqrt(v / (1 - b2^t)) + eps)        (one scale per line)
    D     =  c o S, rescaled to ||D|| = ||S||         (per weight)

(the reference also normalises ``c`` to unit RMS first; the rescale cancels that factor, so it
is not computed). Then all sketched weights' updates together are scaled so that
``||dW|| = rowadam_step x ||W||`` over all of them (``dW = D A`` or ``A D``, the full-size
update), at the peak learning rate: the optimizer applies ``lr x U``, so ``U`` is scaled for
``--lr`` and the schedule's ``lr / --lr`` shapes the step as it does Adam's. The KL controller
scales the result (``kl_max_scale = 3``: a step may also grow, as the reference allows).

Exact across layouts: every sketch line, its moment and its scale live on the TP rank that holds
that row (right) or column (left) of ``W``; the per-weight norms ``||S||``, ``||D||`` and
``||dW||`` (``||D A||^2 = <D^T D, A A^T>``, a Gram product that forms no ``m x n`` matrix) are
summed over TP, the totals over all weights and the weights' norm over the pipeline, and the
sketches are already DP means, so TP/PP/DP layouts give the TP=1 update up to rounding. A tied
embedding's pipeline copy is counted once; padded vocabulary rows are not part of ``||W||``.
"""

import math
from typing import Dict

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.logra.update_memory import RowAdamMemory
from logra_megatron.models.weights import global_indices

BETA2 = 0.95
"""The reference's decay of the per-line second moment (not ``--adam-beta2``, whose default
0.999 suits moments that see the same coordinates every step)."""
KL_MAX_SCALE = 3.0
"""The reference's cap on the KL controller's step scale: ``alpha = min(3, sqrt(budget / KL))``."""


class RowAdam(RowAdamMemory):
    """Per-line second moments over every sketched weight of a
    :class:`~logra_megatron.logra.sketch_buffer.SketchBuffer`; implements
    :class:`~logra_megatron.logra.update_rules.UpdateRule`. Its state names, layout, projections
    and memory are declared, torch-free, by :class:`~logra_megatron.logra.update_memory.RowAdamMemory`."""

    kl_max_scale = KL_MAX_SCALE

    def __init__(self, buffer, optimizer_config, logra_config: LogRAConfig):
        if buffer.zero1:
            raise ValueError("RowAdam keeps per-line state and does not support ZeRO-1 slices")
        self.buffer = buffer
        self.eps = optimizer_config.adam_eps
        self.peak_lr = optimizer_config.lr
        self.relative_step = logra_config.rowadam_step
        self.line_exp_avg_sq = buffer.flat.new_zeros(buffer.line_numel, dtype=torch.float32)

    @torch.no_grad()
    def update(self, grad: torch.Tensor, lr: float, weight_decay: float, step: int) -> torch.Tensor:
        """``U`` for the whole flat buffer from the reduced sketch gradient ``grad``; ``lr`` and
        ``weight_decay`` are applied by the optimizer (``lr / --lr`` scales the step)."""
        weights = self.buffer.weights
        update = torch.empty_like(grad)
        # Per weight, this rank's part of ||S||^2, ||D||^2, ||dW(D)||^2 and ||W||^2.
        stats = torch.zeros(len(weights), 4, dtype=torch.float64, device=grad.device)
        bias_correction = 1.0 - BETA2**step
        for index, entry in enumerate(weights):
            sketch, out = entry.view(grad), entry.view(update)
            right = entry.sketch.side == RIGHT
            moment = entry.line_view(self.line_exp_avg_sq)
            moment.mul_(BETA2).add_(sketch.square().mean(dim=1 if right else 0), alpha=1.0 - BETA2)
            scale = (moment / bias_correction).sqrt_().add_(self.eps).reciprocal_()
            torch.mul(sketch, scale[:, None] if right else scale[None, :], out=out)
            stats[index, 0] = sketch.double().square().sum()
            stats[index, 1] = out.double().square().sum()
            stats[index, 2] = _mapped_squared_norm(out, entry.sketch.projection, right)
            stats[index, 3] = _weight_squared_norm(entry)
        if parallel.tp_size() > 1:  # every sketched weight is split over TP
            dist.all_reduce(stats, group=parallel.tp_group())
        to_sketch_norm = torch.where(stats[:, 1] > 0, (stats[:, 0] / stats[:, 1]).sqrt(), stats.new_zeros(()))
        counted = torch.tensor([not entry.pipeline_copy for entry in weights], dtype=torch.float64,
                               device=grad.device)
        totals = torch.stack([(counted * to_sketch_norm.square() * stats[:, 2]).sum(), (counted * stats[:, 3]).sum()])
        if parallel.pp_size() > 1:
            dist.all_reduce(totals, group=parallel.pp_group())
        update_norm, weight_norm = math.sqrt(float(totals[0])), math.sqrt(float(totals[1]))
        size = 0.0
        if update_norm > 0 and self.peak_lr > 0:
            size = self.relative_step * weight_norm / (self.peak_lr * update_norm)
        for index, entry in enumerate(weights):
            entry.view(update).mul_(float(to_sketch_norm[index]) * size)
        return update

    def state(self) -> Dict[str, torch.Tensor]:
        return {"line_exp_avg_sq": self.line_exp_avg_sq}

    def rotate(self, state: Dict[str, torch.Tensor], change: torch.Tensor, side: str) -> None:
        """Nothing to carry: a change of the projected basis leaves every line's moment valid."""

    def after_refresh(self, state: Dict[str, torch.Tensor]) -> None:
        pass

    def reset(self) -> None:
        self.line_exp_avg_sq.zero_()

    def counters(self) -> Dict[str, int]:
        return {}  # the bias correction counts the optimizer's steps

    def load_counters(self, counters: Dict[str, int]) -> None:
        pass


def _mapped_squared_norm(update: torch.Tensor, projection: torch.Tensor, right: bool) -> torch.Tensor:
    """``||U A||^2`` (right: ``U`` is ``m x r``, ``A = projection^T``) or ``||A U||^2`` (left),
    from ``r x r`` Gram matrices, without the ``m x n`` product."""
    update, projection = update.double(), projection.double()
    gram = update.t() @ update if right else update @ update.t()
    return (gram * (projection.t() @ projection)).sum()


def _weight_squared_norm(entry) -> torch.Tensor:
    """``||W||^2`` of this rank's shard (real vocabulary rows only), by row blocks of at most a
    sketch's worth of elements, so no full-size fp64 copy exists."""
    weight = entry.weight.detach()
    rows = weight.shape[0]
    if entry.vocab_rows is not None:
        rows = int((global_indices(weight, entry.name, 0) < entry.vocab_rows).sum())  # a prefix of the block
    block = max(1, entry.numel // max(1, weight.shape[1]))
    total = torch.zeros((), dtype=torch.float64, device=weight.device)
    for first in range(0, rows, block):
        total += weight[first:min(first + block, rows)].double().square().sum()
    return total
