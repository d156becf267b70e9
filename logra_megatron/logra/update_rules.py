"""Update rules of the sketch space: what turns the reduced sketch gradient into the low-rank
update, and the registry of them by name.

A rule sees flat tensors laid out like :class:`~logra_megatron.logra.sketch_buffer.SketchBuffer`
(each sketched weight's elements at the same offsets), restricted to this rank's slice in ZeRO-1
mode. Its state is either per sketch element (laid out like the gradient) or per line (one value
per row of a right sketch, per column of a left one: the lines the projection does not mix, so
the state keeps its meaning when the projection changes); the rule declares which.
:class:`~logra_megatron.logra.optimizer.LogRAOptimizer` does everything around it: the DP
reduction, the gradient norm and clipping, gathering the update over DP, mapping it back through
the projections and applying ``lr`` and decoupled weight decay to the weights, refreshing the
projections, and checkpointing the rule's state (docs/ALGORITHM.md, "Sketch-space Adam").

A rule also declares the memory it holds, for the planner (logra_megatron/planning), which
asks the rule and never compares its name: :meth:`UpdateRule.state_bytes` (its persistent
state), :meth:`UpdateRule.update_temporaries` (what :meth:`UpdateRule.update` allocates besides
``U``), and through :attr:`UpdateRule.projections` whether the norm probes and the range finder's
refresh exist at all. ``logra/update_memory.py`` reads those declarations (with the defaults a
rule that declares less gets) without torch; the package's rules inherit theirs from torch-free
classes there that their registry lines name (``memory=``), so planning imports no rule module.

Adding a rule is one new file with a class implementing :class:`UpdateRule` (its memory
declared on the class) and one line in
:data:`UPDATE_RULES` (declared in ``logra/config.py``, so the flag is read without torch);
``LogRAConfig(update=name)`` selects it, and the planner, the measurement
(``training/measure.py``: the tensors of :meth:`UpdateRule.state` are ``moment_bytes``) and the
trainer take it from there. A rule outside the package needs no line anywhere:
``--logra-update package.module:Class`` imports it (tests/plugins/muon_like.py).
"""

from typing import Dict, Protocol, Tuple

import torch

from logra_megatron.logra.config import UPDATE_RULES
from logra_megatron.logra.update_memory import ELEMENT, LINE, RANGE_FINDER, REDRAW

__all__ = ["UpdateRule", "UPDATE_RULES", "ELEMENT", "LINE", "RANGE_FINDER", "REDRAW"]


class UpdateRule(Protocol):
    """The interface of a sketch-space update rule.

    Constructed as ``Rule(buffer, optimizer_config, logra_config)``, or with a fourth argument,
    its options (``--logra-update-options``), when the class declares an ``options`` dataclass: ``buffer`` is the
    :class:`~logra_megatron.logra.sketch_buffer.SketchBuffer` (``slice_numel``: the length of
    this rank's slice, the whole flat buffer unless ZeRO-1; ``line_numel``; the weights),
    ``optimizer_config`` Megatron's ``OptimizerConfig`` (lr, betas, eps, ...), ``logra_config``
    the :class:`~logra_megatron.logra.config.LogRAConfig` (moment policy at a refresh, ...).
    """

    state_names: Tuple[str, ...]
    """Names of the rule's state tensors. They are the checkpoint keys, per sketched weight:
    ``logra.<weight name>.<state name>``."""

    state_layout: str
    """:data:`ELEMENT`: each state tensor is ``slice_numel`` long, laid out like this rank's
    slice of the sketch buffer (a weight's part is shaped like its sketch). :data:`LINE`: each
    is ``line_numel`` long, one value per line of every weight's sketch
    (:meth:`~logra_megatron.logra.sketch_buffer.SketchedWeight.line_view`); never sliced over DP
    (such a rule refuses ZeRO-1)."""

    projections: str
    """:data:`RANGE_FINDER`: seeded orthonormal projections, refreshed every
    ``--logra-refresh-interval`` steps by a range finder (state follows by :meth:`rotate`).
    :data:`REDRAW`: a fresh seeded Rademacher projection before every step's backward
    (logra/refresh.py, :class:`~logra_megatron.logra.refresh.RademacherRedraw`)."""

    kl_max_scale: float
    """The KL controller's largest step scale when ``--kl-max-scale`` is not given."""

    @classmethod
    def state_bytes(cls, slice_numel: int, line_numel: int) -> int:
        """Bytes of the rule's state on one rank (what :meth:`state` returns once constructed),
        for a buffer whose slice has ``slice_numel`` elements and whose sketches have
        ``line_numel`` lines in all. Optional: without it, ``update_memory.state_bytes`` counts
        one fp32 tensor per name in :attr:`state_names`, of the length :attr:`state_layout` says."""

    @classmethod
    def update_temporaries(cls, slice_numel: int, line_numel: int) -> Tuple[int, int]:
        """``(peak, held)``: bytes :meth:`update` allocates besides the ``U`` it returns.
        ``peak``: the most its temporaries hold at once before ``U`` exists (freed by the time
        it returns); ``held``: what is still live when ``U`` is allocated (freed right after,
        e.g. Adam's denominator). The planner replays them on top of the step's other live
        tensors (planning/activations.py). Optional: without it, ``(0, 0)``."""

    def update(self, grad: torch.Tensor, lr: float, weight_decay: float, step: int) -> torch.Tensor:
        """Advance the state with ``grad`` (this rank's slice of the DP-mean, clipped sketch
        gradient) and return the low-rank update ``U`` for the same slice. ``step`` counts
        optimizer steps from 1 (this one included; it restarts after ``reset``). The optimizer
        then applies ``W <- (1 - lr * weight_decay) W - lr * P U`` (left sketch) or
        ``... - lr * U Q^T`` (right); ``lr`` and ``weight_decay`` (the sketch group's current
        values) are passed for rules whose direction depends on them."""

    def state(self) -> Dict[str, torch.Tensor]:
        """The live state slices by ``state_names`` (saved, gathered and restored in place)."""

    def rotate(self, state: Dict[str, torch.Tensor], change: torch.Tensor, side: str) -> None:
        """At a refresh, carry one weight's state into its new basis, in place. ``state`` holds
        that weight's full (not sliced) views, shaped like its sketch (``r x n`` for a left
        sketch, ``m x r`` for a right one); ``change = Q_new^T Q_old`` (``r x r``). Called for
        :data:`RANGE_FINDER` rules only."""

    def after_refresh(self, state: Dict[str, torch.Tensor]) -> None:
        """After every weight was rotated: whole-buffer work (e.g. dropping a moment).
        ``state`` holds the full flat tensors."""

    def reset(self) -> None:
        """Forget all history (zero the state, restart internal counters)."""

    def counters(self) -> Dict[str, int]:
        """Scalar state to checkpoint (names distinct from ``step_count`` and
        ``refreshes_done``)."""

    def load_counters(self, counters: Dict[str, int]) -> None:
        """Restore from a dict holding (at least) the names :meth:`counters` returns."""
