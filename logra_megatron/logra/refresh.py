"""The refresh policy: when projections change, and how (docs/ALGORITHM.md, "Refresh").

Every ``refresh_interval`` optimizer steps (step 0 included) the step's backward also runs a
randomized range finder: :meth:`RangeFinderRefresh.arm` gives each sketch this rank's rows of a
seeded Gaussian test matrix ``Omega`` before the backward, the samples are summed over TP and
DP after it, and :meth:`RangeFinderRefresh.refresh` replaces each projection by the top singular
vectors of its sample, after the step's update. The update rule's state is carried into the new
bases by the rule itself (:meth:`~logra_megatron.logra.update_rules.UpdateRule.rotate`). With
the identity projection nothing is ever refreshed.

Rules that declare ``projections = REDRAW`` (``--logra-update rowadam``) use
:class:`RademacherRedraw` instead: no range finder, a fresh seeded Rademacher projection before
every step's backward (docs/ALGORITHM.md, "RowAdam").
"""

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.projection import rademacher, range_finder_basis
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.logra.sketch_buffer import SketchBuffer, SketchedWeight
from logra_megatron.logra.update_memory import RANGE_FINDER, REDRAW  # noqa: F401 (how a rule's projections change)
from logra_megatron.models.weights import shard_of
from logra_megatron.seeding import name_seed, seeded_gaussian

REDRAW_STREAM = 2_000_003
"""Offset of the redraws' counter, apart from the other seeded draws of a weight."""


class RangeFinderRefresh:
    """Range-finder refreshes of every projection of a :class:`SketchBuffer`."""

    def __init__(self, logra_config: LogRAConfig, buffer: SketchBuffer):
        self.logra = logra_config
        self.buffer = buffer
        self.refreshes_done = 0  # also seeds the next test matrices

    def is_refresh_step(self, step_count: int) -> bool:
        return not self.logra.identity_projection and step_count % self.logra.refresh_interval == 0

    def arm(self, step_count: int) -> None:
        """Before a step's backward: on a refresh step give every sketch its test matrix and a
        zeroed range sample, otherwise clear both."""
        refresh = self.is_refresh_step(step_count)
        for entry in self.buffer.weights:
            sketch = entry.sketch
            if refresh:
                sketch.test_matrix = self._test_matrix(entry)
                rows = sketch.in_features if sketch.side == RIGHT else sketch.out_features
                sketch.range_sample = sketch.test_matrix.new_zeros(rows, sketch.test_matrix.shape[1])
            else:
                sketch.test_matrix = sketch.range_sample = None

    def _test_matrix(self, entry: SketchedWeight) -> torch.Tensor:
        """This rank's rows of the seeded Gaussian test matrix Omega (full rows: the weight's
        non-projected dimension at TP=1, sharded exactly like the weight)."""
        sketch = entry.sketch
        columns = min(sketch.rank + self.logra.oversampling,
                      sketch.in_features if sketch.side == RIGHT else sketch.out_features)
        seed = name_seed(self.logra.seed, entry.name, 1 + self.refreshes_done)
        weight = entry.weight
        if sketch.side == RIGHT:  # Omega spans the (TP-split) output rows
            full_rows = sketch.out_features * (parallel.tp_size() if weight.tensor_model_parallel else 1)
            omega = seeded_gaussian(full_rows, columns, seed, device=weight.device)
            return shard_of(omega, weight, entry.name).contiguous()
        full_rows = sketch.in_features * (parallel.tp_size() if weight.tensor_model_parallel else 1)
        omega = seeded_gaussian(full_rows, columns, seed, device=weight.device)
        return shard_of(omega.t(), weight, entry.name).t().contiguous()

    def reduce_samples(self) -> None:
        """After the backward of a refresh step: sum each range sample over TP (each rank saw
        its shard of the weight) and DP (each replica its share of the batch)."""
        for entry in self.buffer.weights:
            sample = entry.sketch.range_sample
            if parallel.tp_size() > 1:
                dist.all_reduce(sample, group=parallel.tp_group())
            if self.buffer.dp > 1:
                dist.all_reduce(sample, group=parallel.dp_group())

    def refresh(self, rule) -> None:
        """New bases from the reduced range samples; ``rule``'s state follows them."""
        live = rule.state()
        full = {name: self.buffer.full(tensor) for name, tensor in live.items()}
        full = {name: tensor.clone() if tensor is live[name] else tensor for name, tensor in full.items()}
        for entry in self.buffer.weights:
            sketch = entry.sketch
            old = sketch.projection
            new = range_finder_basis(sketch.range_sample, sketch.rank)
            change = new.t() @ old  # r x r: coordinates of the old basis in the new one
            rule.rotate({name: entry.view(tensor) for name, tensor in full.items()}, change, sketch.side)
            sketch.projection = new
            sketch.test_matrix = sketch.range_sample = None
        rule.after_refresh(full)
        for name, tensor in live.items():
            tensor.copy_(self.buffer.local_slice(full[name]))
        self.refreshes_done += 1


class RademacherRedraw:
    """A fresh projection for every step, as the reference implementation draws one per update.

    Before each step's backward (:meth:`arm`) every sketch gets a ``projected x r`` matrix of
    signs / sqrt(r) seeded by (base seed, the weight's global name, the number of updates
    committed so far): the same on every TP/PP/DP rank that shares it, at any layout, and the
    same again after a resume (the count is checkpointed as ``refreshes_done``) or after a
    skipped step (nothing was committed). The backward sketches through it and the update maps
    back through it; committing the step counts it (:meth:`refresh`), so the next backward
    sketches through a new one. The count is not reset with the optimizer's state, so a new
    training phase does not repeat an earlier phase's projections.
    """

    def __init__(self, logra_config: LogRAConfig, buffer: SketchBuffer):
        self.logra = logra_config
        self.buffer = buffer
        self.refreshes_done = 0
        """Updates committed with a drawn projection; seeds the next draw."""

    def is_refresh_step(self, step_count: int) -> bool:
        return True  # every committed step retires its projection

    def arm(self, step_count: int) -> None:
        for entry in self.buffer.weights:
            sketch = entry.sketch
            projected = sketch.in_features if sketch.side == RIGHT else sketch.out_features
            seed = name_seed(self.logra.seed, entry.name, REDRAW_STREAM + self.refreshes_done)
            sketch.projection = rademacher(projected, sketch.rank, seed, device=entry.weight.device)
            sketch.test_matrix = sketch.range_sample = None

    def reduce_samples(self) -> None:
        """Nothing to reduce: there is no range finder."""

    def refresh(self, rule) -> None:
        """After a committed update: the next :meth:`arm` draws a new projection. The rule's
        per-line state needs no change of basis."""
        self.refreshes_done += 1
