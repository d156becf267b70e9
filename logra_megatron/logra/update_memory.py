"""What a sketch-space update rule holds in memory, as the rule declares it, readable without torch.

The memory planner (logra_megatron/planning) asks these functions about ``--logra-update``'s rule
and never compares its name. A rule declares (logra/update_rules.py: ``UpdateRule``):

- ``state_layout`` and ``state_names``; ``state_bytes(slice_numel, line_numel)``: the bytes of its
  state on one rank (what its ``state()`` returns; by default one fp32 tensor per state name);
- ``update_temporaries(slice_numel, line_numel)``: ``(peak, held)`` bytes its ``update``
  allocates besides the ``U`` it returns (by default none);
- ``projections``: :data:`RANGE_FINDER` rules have the norm probes and the range finder's refresh
  steps, :data:`REDRAW` rules neither.

The rule class itself carries these. The planner reads them from a torch-free class when the
rule's registry line names one (``UPDATE_RULES.register(..., memory="module:Class")``; the
package's rules inherit theirs from the classes below, so each number is written once), and
otherwise from the rule class, imported (an outside rule, or an in-package rule without such a
line: right, only slower to plan, since the rule modules load torch and megatron-core).
"""

import importlib
from typing import Tuple

from logra_megatron.logra.config import UPDATE_RULES

ELEMENT, LINE = "element", "line"
"""Layouts of an update rule's state: per sketch element (like the flat buffer, sliced in ZeRO-1
mode), or per line (logra/sketch_buffer.py: ``SketchedWeight.line_view``)."""
RANGE_FINDER, REDRAW = "range-finder", "redraw"
"""How an update rule's projections change (``UpdateRule.projections``): by range-finder
refreshes (logra/refresh.py: ``RangeFinderRefresh``), or redrawn for every step
(``RademacherRedraw``)."""
FP32 = 4
DEFAULT_STATE_ELEMENT_BYTES = FP32
"""What :func:`state_bytes` assumes of a rule that declares only its layout: fp32 state tensors."""


class SketchAdamWMemory:
    """The memory of sketch-space AdamW (logra/update_adamw.py: ``SketchAdamW`` inherits it)."""

    state_names = ("exp_avg", "exp_avg_sq")
    state_layout = ELEMENT
    projections = RANGE_FINDER

    @classmethod
    def state_bytes(cls, slice_numel: int, line_numel: int) -> int:
        """Two fp32 moments per element of this rank's slice."""
        return 2 * slice_numel * FP32

    @classmethod
    def update_temporaries(cls, slice_numel: int, line_numel: int) -> Tuple[int, int]:
        """``update``: ``sqrt(v)`` and its quotient by the bias correction (two slices at once),
        the latter kept as the denominator while ``U`` is allocated."""
        return 2 * slice_numel * FP32, slice_numel * FP32


class RowAdamMemory:
    """The memory of RowAdam (logra/update_rowadam.py: ``RowAdam`` inherits it)."""

    state_names = ("line_exp_avg_sq",)
    state_layout = LINE
    projections = REDRAW

    @classmethod
    def state_bytes(cls, slice_numel: int, line_numel: int) -> int:
        """One fp32 second moment per line of every sketch (never sliced: no ZeRO-1)."""
        return line_numel * FP32

    @classmethod
    def update_temporaries(cls, slice_numel: int, line_numel: int) -> Tuple[int, int]:
        """``update``'s per-weight squares, scales and products: at most one sketch's worth at a
        time, bounded by the whole slice; nothing is left when it returns but ``U``."""
        return slice_numel * FP32, 0


def declared_memory(name: str):
    """What ``--logra-update name`` declares of its memory: the torch-free class its registry line
    names (``memory=``), else the rule class itself (imported)."""
    entry = UPDATE_RULES.declared(name)
    path = entry.info.get("memory") if entry is not None else None
    if path is None:
        return UPDATE_RULES.get(name)
    module, attr = path.split(":", 1)
    return getattr(importlib.import_module(module), attr)


def state_bytes(rule, slice_numel: int, line_numel: int) -> int:
    """The rule's state bytes on one rank as it declares them (``state_bytes``), or one fp32
    tensor per state name, of the length its ``state_layout`` gives, for a rule that declares
    only those."""
    declared = getattr(rule, "state_bytes", None)
    if declared is not None:
        return int(declared(slice_numel, line_numel))
    length = line_numel if rule.state_layout == LINE else slice_numel
    return len(rule.state_names) * length * DEFAULT_STATE_ELEMENT_BYTES


def update_temporaries(rule, slice_numel: int, line_numel: int) -> Tuple[int, int]:
    """``(peak, held)`` as the rule declares them (``update_temporaries``), or ``(0, 0)``: a rule
    that declares nothing is planned as writing ``U`` directly."""
    declared = getattr(rule, "update_temporaries", None)
    if declared is None:
        return 0, 0
    peak, held = declared(slice_numel, line_numel)
    return int(peak), int(held)


def uses_norm_probes(rule) -> bool:
    """Whether the optimizer estimates the gradient outside the sketch with norm probes for this
    rule: not under :data:`REDRAW`, whose fresh Rademacher sketch's norm is itself an unbiased
    estimate of the gradient's (logra/sketch_optimizer.py builds no estimator then)."""
    return rule.projections != REDRAW


def uses_range_finder(rule) -> bool:
    """Whether refresh steps run the range finder (its test matrices and samples live through that
    step's backward): :data:`RANGE_FINDER` rules only."""
    return rule.projections == RANGE_FINDER
