"""An estimate of the full gradient norm of the sketched weights, from the same backward
(docs/ALGORITHM.md, "Gradient norm").

The sketch holds only the gradient's part inside the projection: for a right sketch
``||G||^2 = ||G Q||^2 + ||G (I - Q Q^T)||^2`` (``Q`` orthonormal), so clipping on the sketch norm
clips later than dense Adam would, and a logged sketch norm is not comparable with a dense one.
The missing part is estimated without a dense gradient: with a Gaussian ``Omega`` (``n x k``,
i.i.d. N(0, 1)) and ``Omega' = (I - Q Q^T) Omega``, the backward accumulates
``R = G Omega' = dY^T (X Omega')`` (``m x k``; left sketches symmetric: ``Omega'^T G``), and
``E ||R||^2 = k ||G (I - Q Q^T)||^2``. The estimate ``||S||^2 + ||R||^2 / k`` is unbiased and
exact when the projection has full rank.

``Omega`` is drawn per weight and step from (seed, weight name, step), the same on every TP and
DP rank, so ``R`` is linear in ``G``: it sums over microbatches, its DP mean is the sample of
the mean gradient, and TP shards hold blocks of the TP=1 sample (squares are summed over the
model-parallel group, like the sketch's). All samples are views into one flat fp32 buffer,
all-reduced over DP in one call.
"""

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from logra_megatron import parallel
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.ops.norms import squared_norm
from logra_megatron.seeding import name_seed, seeded_gaussian

SEED_STREAM = 1_000_003
"""Offset of the probes' counter, apart from the projections' and the range finder's."""


class GradNormEstimator:
    """``probes`` Gaussian probes per sketched weight of a
    :class:`~logra_megatron.logra.sketch_buffer.SketchBuffer`."""

    def __init__(self, buffer, probes: int, seed: int):
        self.buffer = buffer
        self.probes = probes
        self.seed = seed
        shapes = []
        for entry in buffer.weights:
            sketch = entry.sketch
            shapes.append((sketch.out_features, probes) if sketch.side == RIGHT else (probes, sketch.in_features))
        device = buffer.flat.device
        self.flat = torch.zeros(sum(math.prod(shape) for shape in shapes), device=device)
        self._views = []
        offset = 0
        for shape in shapes:
            self._views.append(self.flat[offset:offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)

    def arm(self, step_count: int) -> None:
        """Before the backward: this step's probes ``Omega' = (I - Q Q^T) Omega`` and zeroed
        samples on every sketch."""
        self.flat.zero_()
        for entry, sample in zip(self.buffer.weights, self._views):
            sketch = entry.sketch
            projection = sketch.projection
            omega = seeded_gaussian(projection.shape[0], self.probes,
                                    name_seed(self.seed, entry.name, SEED_STREAM + step_count),
                                    device=projection.device)
            sketch.norm_probe = omega - projection @ (projection.t() @ omega)
            sketch.norm_sample = sample

    def disarm(self) -> None:
        for entry in self.buffer.weights:
            entry.sketch.norm_probe = entry.sketch.norm_sample = None

    def residual_squared_norm(self) -> float:
        """After the backward: the estimate of ``sum ||G (I - Q Q^T)||^2`` over the whole model's
        sketched weights (DP mean of the samples; squares summed over the model-parallel group)."""
        if parallel.dp_size() > 1:
            dist.all_reduce(self.flat, group=parallel.dp_group())
            self.flat.div_(parallel.dp_size())
        total = squared_norm(self.flat)
        for entry, sample in zip(self.buffer.weights, self._views):
            if entry.pipeline_copy:  # a tied embedding's copy on the last stage: counted once
                total -= squared_norm(sample)
        squared = (total / self.probes).reshape(1)
        dist.all_reduce(squared, group=parallel_state.get_model_parallel_group())
        return float(squared)

    def state_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
