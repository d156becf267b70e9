"""A job's memory per GPU, whether it fits, and the layout that fits best.

:func:`plan_memory` adds, for every pipeline stage, the persistent training state
(:mod:`logra_megatron.planning.state`) and the step's transient peak
(:mod:`logra_megatron.planning.activations`: ``peak_step_bytes``, the peak of tensor allocations
during one step beyond what was live before it, the KL controller's copies included; and
Megatron's global buffer for the attention scores, kept after the first step). The
stage that needs the most sets the job's figure: every GPU must hold its stage.
:func:`search_layouts` tries every TP x PP x DP split of a number of GPUs.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from logra_megatron.errors import UserError
from logra_megatron.ops.multiples import ceil_div
from logra_megatron.planning import activations
from logra_megatron.planning.settings import PlanSettings, settings_for_row
from logra_megatron.planning.state import (HOST_COMPONENTS, TRANSIENT_COMPONENTS, check_settings, stage_host_state,
                                           worst_dp_rank_state)

PEAK_KEY = "peak_step_bytes"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the bytes on its busiest data-parallel rank (any TP rank)."""

    stage: int
    dp_rank: int
    state: Dict[str, int]
    """:data:`~logra_megatron.planning.state.STATE_COMPONENTS` of the rank."""
    step: Dict[str, int]
    """The step's transient figures (activations.py); only ``peak_step_bytes`` is added."""
    global_buffer_bytes: int = 0
    """Megatron's global memory buffer for the attention scores: allocated by the first step and
    kept (activations.py: ``global_buffer_bytes``)."""
    host: Dict[str, int] = field(default_factory=dict)
    """:data:`~logra_megatron.planning.state.HOST_COMPONENTS` of the rank (host memory)."""

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def persistent_bytes(self) -> int:
        """Held across steps: the state without its transient parts (inside the step's peak),
        and Megatron's global buffer."""
        state = sum(value for key, value in self.state.items() if key not in TRANSIENT_COMPONENTS)
        return state + self.global_buffer_bytes

    @property
    def peak_step_bytes(self) -> int:
        return self.step.get(PEAK_KEY, 0)

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.peak_step_bytes

    def to_dict(self) -> dict:
        return {"stage": self.stage, "dp_rank": self.dp_rank, "components": dict(self.state),
                "global_buffer_bytes": self.global_buffer_bytes, "step": dict(self.step),
                "persistent_bytes": self.persistent_bytes,
                "peak_step_bytes": self.peak_step_bytes, "total_bytes": self.total_bytes,
                "host_components": {key: self.host.get(key, 0) for key in HOST_COMPONENTS},
                "host_bytes": self.host_bytes}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-stage bytes of one job; ``total_per_gpu`` is what its busiest GPU needs."""

    settings: PlanSettings
    stages: Tuple[StagePlan, ...]

    @property
    def busiest(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total_bytes)

    @property
    def total_per_gpu(self) -> int:
        return self.busiest.total_bytes

    @property
    def host_per_gpu(self) -> int:
        """Host bytes of the rank that needs the most (its GPU's share of a node's host memory)."""
        return max(stage.host_bytes for stage in self.stages)

    @property
    def host_total(self) -> int:
        """Host bytes of every rank of the job (each stage's busiest DP rank, times TP x DP)."""
        s = self.settings
        return sum(stage.host_bytes for stage in self.stages) * s.tensor_parallel * s.data_parallel

    def to_dict(self) -> dict:
        s = self.settings
        return {"optimizer": s.optimizer, "kl_control": s.kl_control,
                "distributed_optimizer": s.distributed_optimizer, "layout": layout_dict(s),
                "total_per_gpu_bytes": self.total_per_gpu, "gpu_bytes": self.total_per_gpu,
                "host_bytes": self.host_per_gpu, "host_total_bytes": self.host_total,
                "busiest_stage": self.busiest.stage, "stages": [stage.to_dict() for stage in self.stages]}


def layout_dict(settings: PlanSettings) -> dict:
    layout = {"tensor_parallel": settings.tensor_parallel, "pipeline_parallel": settings.pipeline_parallel,
              "data_parallel": settings.data_parallel, "gpus": settings.world_size}
    if settings.virtual_pipeline is not None:  # chunks per pipeline rank (each stage below is a rank)
        layout["virtual_pipeline"] = settings.virtual_pipeline
    return layout


def plan_memory(settings: PlanSettings) -> MemoryPlan:
    """Every pipeline stage's bytes (its busiest DP rank) for ``settings``; under a virtual
    pipeline a stage is a pipeline rank with all its model chunks."""
    check_settings(settings)
    stages = []
    for stage in range(settings.pipeline_parallel):
        dp_rank, state = worst_dp_rank_state(settings, stage)
        stages.append(StagePlan(stage, dp_rank, state, dict(activations.activation_bytes(settings, stage)),
                                activations.global_buffer_bytes(settings, stage), stage_host_state(settings, stage, dp_rank)))
    return MemoryPlan(settings, tuple(stages))


def fits(plan: MemoryPlan, gpu_memory_bytes: int, reserve_bytes: int = 0) -> Tuple[bool, int]:
    """``(fits, headroom)``: whether every GPU holds its stage with ``reserve_bytes`` to spare,
    and the bytes left on the busiest GPU (negative: missing)."""
    headroom = gpu_memory_bytes - reserve_bytes - plan.total_per_gpu
    return headroom >= 0, headroom


@dataclass(frozen=True)
class LayoutChoice:
    """One optimizer's search: the chosen layout's plan, its fit, every candidate, and the
    layouts that could not run (with why)."""

    plan: Optional[MemoryPlan]
    fits: bool
    headroom: int
    candidates: List[dict] = field(default_factory=list)
    skipped: List[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"best": None if self.plan is None else dict(self.plan.to_dict(), fits=self.fits,
                                                               headroom_bytes=self.headroom),
                "candidates": self.candidates, "skipped": self.skipped}


def _divisors(number: int) -> List[int]:
    return [value for value in range(1, number + 1) if number % value == 0]


def layouts(gpus: int, gpus_per_node: int) -> List[Tuple[int, int, int]]:
    """Every ``(tp, pp, dp)`` with ``tp x pp x dp == gpus`` and TP within a node."""
    return [(tp, pp, gpus // (tp * pp)) for tp in _divisors(gpus) if tp <= gpus_per_node
            for pp in _divisors(gpus // tp)]


def search_layouts(base: PlanSettings, gpus: int, gpu_memory_bytes: int,
                   optimizers: Sequence[str] = ("adam", "logra"), gpus_per_node: int = 8,
                   reserve_bytes: int = 0, rollout_sequences: Optional[int] = None) -> Dict[str, LayoutChoice]:
    """Per optimizer row (settings.py ``ROWS``, applied by ``settings_for_row``), the TP x PP x DP
    layout of ``gpus`` GPUs whose busiest GPU needs the least memory (the most headroom; among
    equals the smaller TP, then PP), with everything else of ``base`` kept (micro-batch, global batch, sequence length, ...).

    ``rollout_sequences``: sequences a colocated rollout engine generates at once over all
    replicas; each layout's replicas hold ``ceil(n / DP)`` of them (default: ``base.rollout``
    as it is, per replica). Layouts that cannot split the model or the batch are skipped."""
    if gpus < 1 or gpus_per_node < 1:
        raise UserError("--gpus and --gpus-per-node must be >= 1")
    choices = {}
    for optimizer in optimizers:
        candidates, skipped, best = [], [], None
        for tp, pp, dp in layouts(gpus, gpus_per_node):
            # --sequence-parallel is the user's: kept where TP > 1, off at TP 1 (as Megatron-LM
            # turns it off there); the search does not vary it.
            settings = replace(settings_for_row(base, optimizer), tensor_parallel=tp, pipeline_parallel=pp,
                               data_parallel=dp, sequence_parallel=base.sequence_parallel and tp > 1)
            if rollout_sequences is not None:
                per_replica = ceil_div(rollout_sequences, dp)
                settings = replace(settings, rollout=replace(
                    settings.rollout, sequences_in_flight=per_replica,
                    max_tokens=settings.rollout.max_tokens if per_replica else 0))
            try:
                plan = plan_memory(settings)
            except UserError as error:
                skipped.append({"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": dp,
                                "reason": str(error)})
                continue
            ok, headroom = fits(plan, gpu_memory_bytes, reserve_bytes)
            candidates.append(dict(layout_dict(settings), total_per_gpu_bytes=plan.total_per_gpu,
                                   host_bytes=plan.host_per_gpu, fits=ok, headroom_bytes=headroom))
            key = (plan.total_per_gpu, tp, pp)
            if best is None or key < best[0]:
                best = (key, plan, ok, headroom)
        candidates.sort(key=lambda row: (row["total_per_gpu_bytes"], row["tensor_parallel"], row["pipeline_parallel"]))
        if best is None:
            choices[optimizer] = LayoutChoice(None, False, 0, candidates, skipped)
        else:
            choices[optimizer] = LayoutChoice(best[1], best[2], best[3], candidates, skipped)
    return choices
