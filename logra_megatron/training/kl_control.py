"""Predicted-KL step control: forecast how far an update moves the policy, scale it to a target.

Around any training optimizer (LoGRA or dense Adam; :mod:`logra_megatron.training.optimizer`),
one controlled step is (docs/ALGORITHM.md, "KL control"):

1. ``optimizer.propose()`` computes the update ``D`` (moments advance once; they do not depend
   on the step size) and commits nothing.
2. Forecast ``KL_pred = E_tokens KL(p_W || p_{W+D})`` on a probe set (the response tokens of a
   few sequences of the current batch), without a copy of the weights:
   ``optimizer.preview(s)`` makes forward passes see ``W + s D`` (LoGRA: a side path of two
   thin matmuls inside each sketching layer; the small dense remainder set in place from its
   fp32 masters). A forward pass of the probe takes its parts (microbatches of rows, or
   token-budget sequences packed as the GRPO passes pack theirs: ``ProbeSet.packed``) through
   ONE call of Megatron's schedule, so under a pipeline they fill it together; each part's
   logits are reduced to its KL as they come out of the last stage (``ProbeSet.each_logits``).
   - ``probe``: the exact KL at ``W + s D``. The ``s = 0`` logits are never recomputed by a
     forecast: the trainer's policy-loss forward keeps them for the probe's rows, which are rows
     of its batch (:class:`StepLogits`, :meth:`PredictedKLController.step_logits`); without
     that they are computed once per step (:meth:`PredictedKLController.base_logits`). Kept at
     the probe's masked positions only, in the logits' dtype, and reused by the forecast, every
     refinement and the realized KL when it runs on the probe: a step is ``1 + refinements``
     forward passes of the probe set (``2 + refinements`` computing ``s = 0`` itself, where
     recomputing it at every forecast cost ``2 (1 + refinements)``);
   - ``linear``: ``0.5 Var_p(dz)`` per token, ``dz`` the change of the logits along ``D``
     (a forward difference at ``eps D`` divided by ``eps``; a secant at ``D`` when the model
     computes in bf16, where a small difference would round away). KL is then ``s^2`` times it.
   Full-vocabulary sums run on vocab-parallel logits with all-reduces over TP; the vocabulary
   is never gathered. The scalar is computed on the last pipeline stage, broadcast over the
   pipeline and averaged over data-parallel replicas, so every rank agrees.
3. ``s = min(max_scale, sqrt(kl_target / KL_pred))`` (KL is quadratic in the step near zero;
   ``--kl-max-scale`` > 1 lets a step that forecasts below the target grow; unset, it is the
   optimizer's ``kl_max_scale`` where it has one: 3 for LoGRA's ``rowadam`` rule, else 1). Far
   from zero KL grows slower than quadratically (measured on ``tiny``: KL(D) was 0.10 where the
   quadratic extrapolation of small steps gave 0.72), so ``probe`` mode re-forecasts at ``s D`` and
   rescales with the locally measured growth exponent while the forecast misses the target by
   more than ``tolerance`` (at most ``max_refinements`` extra forecasts). The exponent measured
   last carries to the next step's first rescale (``s = (kl_target / KL_pred)^(1/e)``), which
   saves a re-forecast whenever the regime holds (``growth_exponent``, checkpointed).
   Warm start (``probe``): a step's first forecast is where the proposed step has the length
   the last committed step had (``settled_length / ||D||``, ``||D||`` the optimizer's
   ``proposed_step_norm()``; without one the last settled scale, ``settled_scale``; both
   checkpointed; ``s = 1`` at the first step: :meth:`first_scale`), and a forecast there within
   ``tolerance`` of the budget on either side (:meth:`in_band`), or one whose rescale along the
   growth exponent keeps the KL within ``tolerance`` of the budget for any exponent in
   ``[e - EXPONENT_SPREAD, 2]`` around the carried ``e`` (:meth:`rescalable`), is accepted,
   re-centred on the budget: one forecast, where starting at ``s = 1`` took two or three once
   steps need scaling down. A refinement that lands below the band is carried up towards the
   budget as far as the tolerance allows (:meth:`_carried_up`).
   ``kl_pred`` is the forecast KL of the step as committed (``step_scale`` times ``D``), or a
   forecast at another scale carried there along the growth exponent
   (``kl_pred_forecast_scale`` says which).
   With ``--kl-subtract-mismatch`` the target is a budget: ``kl_target`` minus an EMA of the
   KL between the rollout engine's sampling distribution and the trainer's (observed on the
   batch, :meth:`PredictedKLController.observe_mismatch`), floored at half of ``kl_target``:
   the policy change the engine's numerics already add is not spent again by the step.
   ``--kl-target-schedule`` moves ``kl_target`` itself over the RL iterations, from
   ``--kl-target`` to ``--kl-target-final`` (:func:`scheduled_kl_target`; the reference
   implementation's cosine 2e-4 -> 2e-5); the mismatch is subtracted from the scheduled value
   and the floor is half of it. The trainer says which iteration runs (``set_iteration``).
4. ``optimizer.commit(s)``. No master copy is ever read back from rounded model weights.
5. Every ``realized_interval`` steps the KL of the committed step is measured on rows the probe
   did not see (``held_out``; the probe rows when none are given), so the forecast's
   calibration out of sample is visible (``kl_realized``).

Extra memory: what ``optimizer.extra_bytes()`` reports (LoGRA: fp32 copies of the dense
remainder before and after its step; dense Adam: of all its masters), in ``probe`` mode the
kept ``s = 0`` logits of the probe's masked tokens, and of the held-out rows' on a step that
measures the realized KL on them (``masked tokens x V/tp x`` the logits' bytes, on the last
pipeline stage), the logits of one probe microbatch at two scales, and the
full-vocabulary reductions' temporaries, taken over token chunks (``ops/budgets.py:
KL_CHUNK_ELEMENTS``): three chunk-sized copies.
"""

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.utils import get_model_config

from logra_megatron import parallel
from logra_megatron.errors import UserError
from logra_megatron.ops.vocab_parallel import masked_half_variance_sum, masked_kl_sum
from logra_megatron.platform.phases import phase
from logra_megatron.training.config import KLControlConfig
from logra_megatron.training.lm import model_chunks, stream_logits
from logra_megatron.training.optimizer import TrainingOptimizer

EXPONENT_SPREAD = 0.25
"""How far below the carried growth exponent a rescale without a forecast allows the true one
to be (:meth:`PredictedKLController.rescalable`). The local exponent moves slowly from step to
step: on ``smollm2-135m`` (the phase benchmark) the last refinement of one step measured 1.83
and the first of the next 1.93; the upper end stays the quadratic limit, so an accepted rescale
never overshoots the tolerance more than before (it may undershoot, by at most the tolerance,
where the exponent fell by more than this)."""

BF16_LINEAR_EPSILON = 1.0
"""The linear forecast's step (a fraction of D) for models computing in bf16 or fp16."""


def scheduled_kl_target(shape: str, start: float, final: Optional[float], iteration: int, decay_iters: int) -> float:
    """The KL budget of RL iteration ``iteration`` (0-based) before any mismatch is subtracted:
    ``start`` at iteration 0, ``final`` at iteration ``decay_iters - 1`` and after (the reference
    implementation's convention: its endpoints are the first and the last update), with progress
    ``p = min(iteration / max(decay_iters - 1, 1), 1)`` in between:

    - constant: ``start``;
    - linear: ``start + (final - start) p``;
    - cosine: ``final + (start - final) (1 + cos(pi p)) / 2`` (the reference's);
    - exponential: ``start (final / start)^p`` (the same factor every iteration).
    """
    if shape == "constant" or final is None:
        return start
    progress = min(max(iteration, 0) / max(decay_iters - 1, 1), 1.0)
    if shape == "linear":
        return start + (final - start) * progress
    if shape == "cosine":
        return final + 0.5 * (start - final) * (1.0 + math.cos(math.pi * progress))
    if shape == "exponential":
        return start * (final / start) ** progress
    raise ValueError(f"unknown KL target schedule {shape!r}")


@dataclass
class ProbeSet:
    """Rows on which a KL is measured: ``tokens`` ``[n, s]`` and ``mask`` ``[n, s]`` (1 where
    position ``t``'s next-token distribution counts). Left-padded rows (rollouts) carry their
    ``attention_mask`` and ``position_ids``; ``vocab_size`` masks Megatron's vocabulary
    padding. ``micro_batch_size`` rows go through the model at a time, or with ``packed`` the
    rows' real tokens only: each part one packed sequence (``models/positions.py: PackedRows``)
    with its mask in the packed layout ``[1, t]``, so no padding token is computed."""

    tokens: torch.Tensor
    mask: torch.Tensor
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    vocab_size: Optional[int] = None
    micro_batch_size: int = 1
    packed: Optional[list] = None
    """``[(PackedRows, mask [1, t])]``: the parts as packed sequences (``rl/grpo.py: probe_set``)."""
    packed_rows: Optional[list] = None
    """``[rows [k]]`` per packed part: the probe rows (indices into ``tokens``) it packs, in order."""
    rows: Optional[torch.Tensor] = None
    """``[n]``: the probe's rows in the batch the step's forward saw (row ``i`` of the probe is
    row ``rows[i]`` there, with the same columns), so that forward can keep their ``s = 0``
    logits (:class:`StepLogits`); None: the probe is not a part of it."""

    def parts(self):
        if self.packed is not None:
            return list(range(len(self.packed)))
        rows = self.tokens.shape[0]
        return [slice(start, start + self.micro_batch_size) for start in range(0, rows, self.micro_batch_size)]

    def part_mask(self, part) -> torch.Tensor:
        """The mask of ``part`` in the layout of its logits."""
        return self.mask[part] if self.packed is None else self.packed[part][1]

    def part_rows(self, part) -> torch.Tensor:
        """The probe rows (indices into ``tokens``) of ``part``, in the order its logits hold them."""
        if self.packed is not None:
            return self.packed_rows[part]
        return torch.arange(self.tokens.shape[0], device=self.mask.device)[part]

    def batch(self, part):
        """``part`` as :func:`~logra_megatron.training.lm.stream_logits` takes it: its packed
        sequence, its left-padded rows with their mask and positions, or plain causal rows."""
        if self.packed is not None:
            return self.packed[part][0]
        if self.attention_mask is None:
            return self.tokens[part]
        return self.tokens[part], self.attention_mask[part], self.position_ids[part]

    def logits(self, model, part):
        """Vocab-parallel logits of ``part`` alone on the last stage (None elsewhere): ``[rows, s, V/tp]``,
        or ``[1, t, V/tp]`` for a packed part. The controller runs every part together
        (:meth:`each_logits`); this one-part pass is the reference the tests hold it to."""
        kept = {}
        stream_logits(model, [self.batch(part)], kept.__setitem__, self.vocab_size)
        return kept.get(0)

    def each_logits(self, model, consume) -> None:
        """Every part's logits from one forward pass of the probe through Megatron's schedule (its
        parts are the schedule's microbatches, so under PP > 1 they fill the pipeline together):
        ``consume(index, logits)`` on the last stage, part by part in order, each part's logits
        dropped after."""
        stream_logits(model, [self.batch(part) for part in self.parts()], consume, self.vocab_size)


class StepLogits:
    """The ``s = 0`` logits of some batch rows, kept from the step's own forward (the policy loss's
    forward pass, at ``W``) instead of recomputed by a forward pass of the probe: the probe rows
    (and, on a step that measures the realized KL, the held-out rows) are rows of that batch.

    The forward's loss function calls it on the last stage with each microbatch's batch rows and
    vocab-parallel logits (``rl/grpo.py: policy_loss_backward``, ``training/lm.py:
    lm_forward_backward``, their ``keep_logits``); it keeps, per wanted row, the logits at the
    positions its probe's mask counts, in column order, in the logits' dtype (what
    :meth:`PredictedKLController.base_logits` keeps). Both layouts flatten a row's positions in
    column order (padded: column ``t`` of row ``i``; packed: the row's real tokens end to end,
    ``PackedRows.slots`` their columns), so :meth:`base` re-assembles them into the probe's own
    parts, padded or packed, whatever parts the step's forward cut.

    The values are those a forward pass of the probe computes, up to floating-point rounding where
    the two passes group the rows differently (other microbatches, other packing: the matmuls see
    other shapes); bitwise where the groups are the same (``tests/test_step_logits.py``)."""

    def __init__(self, probes):
        self.wanted = {}
        """batch row -> the columns that count ([S] bool, on the mask's device)."""
        for probe in probes:
            if probe is None:
                continue
            if probe.rows is None:
                raise ValueError("a probe kept from the step's forward needs its batch rows (ProbeSet.rows)")
            for index, row in enumerate(probe.rows.tolist()):
                self.wanted[row] = probe.mask[index] != 0
        self.kept = {}
        """batch row -> ``[counted columns, V/tp]`` logits (last stage only)."""

    @torch.no_grad()
    def __call__(self, rows: torch.Tensor, logits: torch.Tensor, packed=None) -> None:
        """Keep what is wanted of one microbatch: ``rows`` ``[b]`` its batch rows, ``logits`` its
        vocab-parallel logits, ``[b, S, V/tp]`` (column ``t`` of row ``rows[i]`` at ``[i, t]``) or,
        with ``packed`` (``PackedRows``), ``[1, t, V/tp]``."""
        logits = logits.detach()
        for local, row in enumerate(rows.tolist()):
            counts = self.wanted.get(row)
            if counts is None:
                continue
            counts = counts.to(logits.device)
            if packed is None:
                values, columns = logits[local], torch.arange(logits.shape[1], device=logits.device)
            else:
                positions = torch.nonzero(packed.rows.to(logits.device) == local).reshape(-1)
                values, columns = logits[0, positions], packed.slots.to(logits.device)[positions]
            inside = columns < counts.numel()
            values, columns = values[inside], columns[inside]
            keep = counts[columns]
            if int(keep.sum()) != int(counts.sum()):
                raise ValueError(f"the step's forward holds {int(keep.sum())} of row {row}'s {int(counts.sum())} "
                                 "counted positions: the probe's columns are not those of the step's batch")
            order = torch.argsort(columns[keep])  # column order (a packed row's tokens already are)
            self.kept[row] = values[keep][order]

    def base(self, probe: ProbeSet) -> list:
        """``probe``'s ``s = 0`` logits as :meth:`PredictedKLController.base_logits` returns them
        (per part: the counted positions' logits, the part's mask positions, its logits' shape),
        taken out of this store (a row serves once); None per part off the last stage."""
        if not parallel.is_last_stage():
            return [None] * len(probe.parts())
        counts = probe.mask != 0
        rank = counts.long().cumsum(dim=1) - 1  # a counted column's place among its row's
        batch_rows = probe.rows.tolist()
        cached = []
        for part in probe.parts():
            members = probe.part_rows(part).tolist()
            missing = [batch_rows[i] for i in members if batch_rows[i] not in self.kept]
            if missing:
                raise ValueError(f"the step's forward kept no logits of batch rows {missing}")
            stored = [self.kept.pop(batch_rows[i]) for i in members]
            part_mask = probe.part_mask(part)
            keep = (part_mask != 0).reshape(-1)
            if probe.packed is None:
                shape = (len(members), part_mask.shape[1], stored[0].shape[-1])
                positions = torch.nonzero(keep).reshape(-1)
                local, columns = positions // part_mask.shape[1], positions % part_mask.shape[1]
            else:
                packed_rows = probe.packed[part][0]
                shape = (1, part_mask.shape[1], stored[0].shape[-1])
                positions = torch.nonzero(keep).reshape(-1)
                local = packed_rows.rows.to(positions.device)[positions]
                columns = packed_rows.slots.to(positions.device)[positions]
            offsets = torch.tensor([0] + [len(values) for values in stored], device=positions.device).cumsum(0)
            members_t = torch.tensor(members, device=positions.device)
            index = offsets[local] + rank.to(positions.device)[members_t[local], columns]
            values = torch.cat(stored) if len(stored) > 1 else stored[0]
            cached.append((values[index.to(values.device)], keep.to(values.device), shape))
            del stored, values
        return cached


class PredictedKLController:
    """Wraps an optimizer step with the forecast-and-scale procedure described above."""

    def __init__(self, config: KLControlConfig, train_iters: int = 1):
        """``train_iters``: the run's RL iterations, over which ``--kl-target-schedule`` runs
        unless ``--kl-target-decay-iters`` says otherwise."""
        self.config = config
        self.decay_iters = config.target_decay_iters or max(1, train_iters)
        """RL iterations over which the budget moves from ``--kl-target`` to ``--kl-target-final``."""
        self.iteration = 0
        """The RL iteration whose steps run now (0-based; the trainer sets it): the schedule's position."""
        self.steps = 0
        """Controlled steps taken (it decides the steps that measure the realized KL)."""
        self.mismatch: Optional[float] = None
        """EMA of the observed engine-vs-trainer KL (``--kl-subtract-mismatch``; None: none seen)."""
        self.settled_scale: Optional[float] = None
        """probe mode: the scale the last committed step settled on; the next step's first forecast
        is made there (a warm start: the proposed steps' size changes slowly from step to step)
        and accepted when it lands in the band (:meth:`in_band`). None: start at ``s = 1``."""
        self.settled_length: Optional[float] = None
        """probe mode: the length of the last committed step (its scale times the proposed step's
        ``proposed_step_norm()``, an optional optimizer method), or None. The warm start aims at a
        step of this length (:meth:`first_scale`)."""
        self.forecasts = 0
        """Forecasts (forward passes of the probe set at some ``s``) the last step made: the first
        and the refinements, not the realized KL's (read by tools/benchmark_step_phases.py)."""
        self.growth_exponent = 2.0
        """probe mode: how KL grew with the step size at the last two forecasts that measured it
        (2 near zero, towards 1 for large steps). The first rescale of the next step uses it: the
        regime changes slowly from step to step, so a step that needs rescaling usually lands
        within tolerance at its first re-forecast instead of its second (docs/KL_CONTROL.md)."""

    def schedule(self) -> dict:
        """The budget's schedule as a checkpoint records it."""
        config = self.config
        return {"shape": config.target_schedule, "start": config.target, "final": config.target_final,
                "decay_iters": self.decay_iters}

    def state_dict(self) -> dict:
        """What a checkpoint keeps (rl/checkpointing.py): the step counter that decides which
        steps measure the realized KL, the mismatch's EMA and the budget's schedule (the
        iteration is the trainer's step, saved beside it)."""
        return {"steps": self.steps, "mismatch": self.mismatch, "schedule": self.schedule(),
                "growth_exponent": self.growth_exponent, "settled_scale": self.settled_scale,
                "settled_length": self.settled_length}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's counters. A scheduled budget continues exactly only with the
        schedule it started on: a resumed run whose schedule differs is a UserError."""
        saved, ours = state.get("schedule"), self.schedule()
        # (A constant budget may be changed on resume, as before schedules existed.)
        if saved is not None and saved != ours and not saved.get("shape") == ours["shape"] == "constant":
            raise UserError(f"the checkpoint's KL budget schedule is {_schedule_text(saved)}, this run's is "
                            f"{_schedule_text(ours)}: resume with the checkpoint's --kl-target, --kl-target-final, "
                            "--kl-target-schedule and --train-iters (or --kl-target-decay-iters) so the budget "
                            "continues where it was")
        self.steps = int(state.get("steps", 0))
        mismatch = state.get("mismatch")
        self.mismatch = None if mismatch is None else float(mismatch)
        self.growth_exponent = float(state.get("growth_exponent", 2.0))  # absent in older checkpoints
        settled = state.get("settled_scale")  # (also absent in older ones: the next step starts at s = 1)
        self.settled_scale = None if settled is None else float(settled)
        length = state.get("settled_length")  # (absent in older ones: the warm start is the settled scale)
        self.settled_length = None if length is None else float(length)

    def set_iteration(self, iteration: int) -> None:
        """The RL iteration (0-based) whose optimizer steps come next: it places the budget on
        its schedule."""
        self.iteration = iteration

    def target(self) -> float:
        """``--kl-target`` as scheduled for the current iteration (:func:`scheduled_kl_target`)."""
        config = self.config
        return scheduled_kl_target(config.target_schedule, config.target, config.target_final, self.iteration,
                                   self.decay_iters)

    def observe_mismatch(self, kl: float) -> None:
        """One batch's observed KL between the rollout engine and the trainer (the same value
        on every rank); folded into the EMA the budget subtracts. Ignored without
        ``--kl-subtract-mismatch`` or when not finite."""
        if not self.config.subtract_mismatch or not math.isfinite(kl):
            return
        weight = self.config.mismatch_ema_weight
        kl = max(kl, 0.0)
        self.mismatch = kl if self.mismatch is None else weight * kl + (1.0 - weight) * self.mismatch

    def budget(self) -> float:
        """The KL a step may cause: ``kl_target`` (as scheduled for this iteration), less the
        mismatch's EMA with ``--kl-subtract-mismatch`` (never below half of that target)."""
        target = self.target()
        if not self.config.subtract_mismatch or self.mismatch is None:
            return target
        return max(0.5 * target, target - self.mismatch)

    # --- forecasts (public for tests and the demo) ------------------------------------------------

    def step_logits(self, probe: ProbeSet, held_out: Optional[ProbeSet] = None) -> Optional[StepLogits]:
        """What the next :meth:`step` wants kept from the step's own forward (pass it to that
        forward as ``keep_logits``, then to :meth:`step`): the probe's rows in ``probe`` mode, the
        held-out rows when that step measures the realized KL on them; None when it wants nothing."""
        wanted = [probe] if self.config.mode == "probe" else []
        if held_out is not None and self._measures_realized(self.steps):
            wanted.append(held_out)
        elif self.config.mode != "probe" and self._measures_realized(self.steps):
            wanted.append(probe)
        return StepLogits(wanted) if wanted else None

    def _measures_realized(self, step: int) -> bool:
        interval = self.config.realized_interval
        return interval > 0 and step % interval == 0

    @torch.no_grad()
    def base_logits(self, model, optimizer: TrainingOptimizer, probe: ProbeSet,
                    step_logits: Optional[StepLogits] = None) -> list:
        """The unchanged policy's (``s = 0``) logits of every probe part, computed once for a
        proposed ``D`` and reused by every forecast of the step (:meth:`kl` with ``base``): one
        forward pass of the probe set instead of one per forecast.

        Kept per part in the logits' own dtype (2 bytes a logit under bf16, half of fp32
        log-probs, and the KL computed from them is bitwise today's), and only at the positions
        the probe's mask counts (the response tokens; the prompt's are dropped): ``[kept, V/tp]``
        per part, with the mask's positions to put them back. Last stage only (None elsewhere).
        Leaves the optimizer previewing ``W``. With ``step_logits`` (kept from the step's own
        forward) no forward pass at all: the logits are taken from there."""
        if step_logits is not None:
            return step_logits.base(probe)
        return self._forward_base(model, optimizer, probe)

    @staticmethod
    def _forward_base(model, optimizer: TrainingOptimizer, probe: ProbeSet) -> list:
        """:meth:`base_logits` by one forward pass of the probe at ``W``."""
        with phase("kl_preview"):
            optimizer.preview(0.0)
        parts = probe.parts()
        cached = [None] * len(parts)

        def keep(index, logits):
            counts = (probe.part_mask(parts[index]).to(logits.device) != 0).reshape(-1)
            cached[index] = (logits.reshape(-1, logits.shape[-1])[counts], counts, logits.shape)

        with phase("kl_probe_forward"):
            probe.each_logits(model, keep)
        return cached

    @staticmethod
    def _restore(entry) -> torch.Tensor:
        """One part's ``s = 0`` logits back in their shape: the cached rows where the mask counts,
        zeros elsewhere (positions the masked sum multiplies by 0, so the KL is unchanged)."""
        rows, keep, shape = entry
        if rows.shape[0] == keep.numel():  # every position counts: the rows are the logits
            return rows.view(shape)
        full = rows.new_zeros(keep.numel(), shape[-1])
        full[keep] = rows
        return full.view(shape)

    def _moved_pass(self, model, optimizer: TrainingOptimizer, probe: ProbeSet, scale: float, per_part) -> float:
        """The probe's one forward pass at ``W + scale D``: ``per_part(index, part, logits)`` (a
        float, summed on the last stage) as each part's logits come out; leaves ``W`` previewed."""
        parts = probe.parts()
        total = 0.0

        def measure(index, logits):
            nonlocal total
            with phase("kl_divergence"):
                total += per_part(index, parts[index], logits)

        with phase("kl_preview"):
            optimizer.preview(scale)
        # exclusive: the divergences run inside the pass, each as its part's logits come out
        with phase("kl_probe_forward", exclusive=True):
            probe.each_logits(model, measure)
        with phase("kl_preview"):
            optimizer.preview(0.0)
        return total

    @torch.no_grad()
    def kl(self, model, optimizer: TrainingOptimizer, probe: ProbeSet, scale: float,
           base: Optional[list] = None) -> float:
        """Agreed mean ``KL(p_W || p_{W + scale D})`` over the probe's masked tokens, for the
        proposed ``D``; leaves the optimizer previewing ``W``. ``base``: the probe's ``s = 0``
        logits from :meth:`base_logits` (one forward pass of the probe per call instead of
        two); without it they are computed here."""
        # Sub-phases (inside kl_forecast or kl_realized; tools/benchmark_step_phases.py): the
        # weights moved to W + s D and back (kl_preview), the probe's forward passes
        # (kl_probe_forward), the KL of their logits (kl_divergence). Each forward pass takes all
        # the probe's parts through the schedule together (ProbeSet.each_logits).
        if base is None:
            base = self._forward_base(model, optimizer, probe)

        def divergence(index, part, new):
            return masked_kl_sum(self._restore(base[index]), new, probe.part_mask(part).to(new.device))

        return self._mean(self._moved_pass(model, optimizer, probe, scale, divergence), probe)

    @torch.no_grad()
    def linear_kl(self, model, optimizer: TrainingOptimizer, probe: ProbeSet) -> float:
        """The linear forecast of ``KL(p_W || p_{W + D})``: ``0.5 Var_p(dz)`` per token."""
        base = self._forward_base(model, optimizer, probe)  # sub-phases as kl()'s
        epsilon = self.config.linear_epsilon
        # read from the model's config, the same on every stage (the logits only the last one has)
        config = get_model_config(model_chunks(model)[0])
        if config.bf16 or config.fp16:
            epsilon = BF16_LINEAR_EPSILON

        def half_variance(index, part, new):
            # on the counted positions only (the cached rows): elsewhere no s = 0 logits are kept
            old, counts, _ = base[index]
            mask = probe.part_mask(part).to(new.device).reshape(-1)[counts]
            return masked_half_variance_sum(old, new.reshape(-1, new.shape[-1])[counts], epsilon, mask)

        return self._mean(self._moved_pass(model, optimizer, probe, epsilon, half_variance), probe)

    @staticmethod
    def _mean(total: float, probe: ProbeSet) -> float:
        count = float(probe.mask.sum().clamp(min=1))
        return parallel.agree_on_scalar(total / count)

    def max_scale(self, optimizer) -> float:
        """``--kl-max-scale``, or when it is not given the optimizer's own cap (an optional
        attribute, ``kl_max_scale``: LoGRA's update rule decides it), or 1."""
        if self.config.max_scale is not None:
            return self.config.max_scale
        return float(getattr(optimizer, "kl_max_scale", 1.0))

    def _scale_for(self, kl: float, max_scale: Optional[float] = None, at: float = 1.0) -> float:
        """The scale of ``D`` whose KL meets the budget, from the forecast ``kl`` at ``at * D``: KL
        grows as ``s^2`` (``linear`` mode, by construction), or as ``s^e`` with the growth exponent
        measured last (``probe`` mode)."""
        if max_scale is None:
            max_scale = self.max_scale(None)
        if kl <= 0:
            return max_scale
        exponent = self.growth_exponent if self.config.mode == "probe" else 2.0
        return min(max_scale, at * (self.budget() / kl) ** (1.0 / exponent))

    def in_band(self, kl: float, scale: float, max_scale: float) -> bool:
        """Whether a step's first forecast ``kl`` at ``scale`` is accepted without another: within
        ``tolerance`` of the budget on either side (``budget / tolerance <= kl <= tolerance *
        budget``), or below it at the largest scale allowed (the step cannot grow)."""
        budget, tolerance = self.budget(), self.config.tolerance
        if kl > tolerance * budget:
            return False
        return kl >= budget / tolerance or scale >= max_scale

    def rescalable(self, kl: float, at: float, scale: float, max_scale: float) -> bool:
        """Whether the forecast ``kl`` at ``at * D``, carried to ``scale * D`` along the growth
        exponent (:meth:`_scale_for`), is accepted without forecasting at ``scale``: whatever the
        growth exponent between the two scales, within ``[e - EXPONENT_SPREAD, 2]`` around the
        exponent ``e`` carried from the last measurement (never below the 1 the controller
        allows; KL grows no faster than ``s^2``), the KL at ``scale`` stays within ``tolerance``
        of the budget: at most ``tolerance * budget`` (at least ``budget / tolerance``, unless
        ``scale`` is the largest allowed). With ``e`` = 2 carried this accepts a first forecast
        within ``tolerance^8`` (2.14) of the budget on either side, at 1.83 (measured on
        ``smollm2-135m``) within 2.0 on either side; at ``e`` <= 1.25 the whole ``[1, 2]``
        counts, as before: within the tolerance band itself at ``e`` = 1."""
        if not kl > 0 or not math.isfinite(kl) or at <= 0:
            return False
        budget, tolerance, ratio = self.budget(), self.config.tolerance, scale / at
        slowest = max(1.0, min(2.0, self.growth_exponent) - EXPONENT_SPREAD)
        low, high = kl * min(ratio**slowest, ratio**2), kl * max(ratio**slowest, ratio**2)
        if high > tolerance * budget:
            return False
        return low >= budget / tolerance or scale >= max_scale

    def first_scale(self, norm: Optional[float], max_scale: float) -> float:
        """Where a step's first forecast is made: ``s = 1`` at the first step; then at the scale
        that gives the proposed step the length the last committed step had
        (``settled_length / ||D||``, with ``norm`` = ``||D||``), or where the optimizer does not
        say its step's length, at the last settled scale. The length carries across a change in
        the update's size that the scale alone does not: Adam's first step is a sign step (every
        coordinate moves by the learning rate), its second ~1.2x shorter on smollm2-135m (2.8x
        less KL at the same scale), so at the scale the first settled on the second forecast
        0.16 of the budget and the search took 3 forecasts; at the first's length, 0.55 of it."""
        if self.settled_scale is None:
            return 1.0
        if norm is not None and self.settled_length is not None and norm > 0 and math.isfinite(norm) \
                and self.settled_length > 0:
            return min(self.settled_length / norm, max_scale)
        return min(self.settled_scale, max_scale)

    def _carried_up(self, kl: float, scale: float, max_scale: float) -> float:
        """A scale whose forecast ``kl`` landed below the band, carried towards the budget along
        the growth exponent only as far as the KL stays within ``tolerance`` of the budget if
        it grew as fast as the controller allows (``s^2``): the committed step is closer to the
        budget, and so is the next step's warm start, without another forecast."""
        budget, tolerance = self.budget(), self.config.tolerance
        if not kl > 0 or kl >= budget / tolerance or scale >= max_scale:
            return scale
        return min(max_scale, scale * (budget / kl) ** (1.0 / self.growth_exponent),
                   scale * math.sqrt(tolerance * budget / kl))

    def _refine(self, model, optimizer, probe, scale: float, start_scale: float, start_kl: float,
                base: Optional[list] = None, max_scale: float = 1.0) -> tuple:
        """Re-forecast at the scaled step until it is within ``tolerance`` of the target (at most
        ``max_refinements`` times), starting from the forecast ``start_kl`` at ``start_scale``. The
        local growth exponent of KL in the step size (2 near zero, towards 1 for large steps) is
        estimated from the last two forecasts, in log space, and used for the next scale. Returns
        the scale, its forecast (extrapolated with the growth exponent from the last forecast
        when the refinements ran out) and the scale that forecast was made at."""
        config, budget = self.config, self.budget()
        previous_scale, previous_kl = start_scale, start_kl
        for _ in range(config.max_refinements):
            kl = self.kl(model, optimizer, probe, scale, base)
            self.forecasts += 1
            if kl > 0 and previous_kl > 0 and previous_scale != scale and previous_kl != kl:
                exponent = math.log(previous_kl / kl) / math.log(previous_scale / scale)
                self.growth_exponent = min(2.0, max(1.0, exponent))
            if kl <= config.tolerance * budget:
                carried = self._carried_up(kl, scale, max_scale)
                return carried, self._grown(kl, scale, carried), scale
            previous_scale, previous_kl = scale, kl
            scale = min(max_scale, scale * (budget / kl) ** (1.0 / self.growth_exponent))
        return scale, self._grown(previous_kl, previous_scale, scale), previous_scale

    def _grown(self, kl: float, at: float, scale: float) -> float:
        """The forecast ``kl`` at ``at * D`` carried to ``scale * D`` along the growth exponent."""
        return kl * (scale / at) ** self.growth_exponent

    # --- the controlled step --------------------------------------------------------------------

    @torch.no_grad()
    def step(self, model, optimizer: TrainingOptimizer, probe: ProbeSet,
             held_out: Optional[ProbeSet] = None, step_logits: Optional[StepLogits] = None) -> dict:
        """One optimizer step under control. ``model`` is the (DDP) model the optimizer trains;
        ``probe`` comes from this rank's batch; ``held_out`` (optional) are rows of the batch
        the probe did not see, for the realized KL; ``step_logits``: what the step's forward
        kept for this step (:meth:`step_logits`), so no forward pass recomputes the ``s = 0``
        logits of those rows.

        Returns ``success, grad_norm, kl_pred, step_scale, kl_realized, controller_time_s,
        controller_extra_bytes, kl_pred_forecast_scale``; ``kl_pred`` is the forecast KL of the
        step as committed (``step_scale`` times the proposed update): a forecast at
        ``kl_pred_forecast_scale`` times it, carried to ``step_scale`` along the growth exponent
        where the two differ (``linear`` mode: the forecast at ``D``'s scale, by ``s^2``; None
        when nothing was forecast).
        """
        config = self.config
        measure_realized = self._measures_realized(self.steps)
        self.steps += 1
        if config.mode == "off" and not measure_realized:
            success, grad_norm, _ = optimizer.step()
            return {"success": success, "grad_norm": grad_norm, "kl_pred": None, "step_scale": 1.0,
                    "kl_realized": None, "controller_time_s": 0.0, "controller_extra_bytes": 0}

        success, grad_norm, _ = optimizer.propose()
        if not success:  # an inf/NaN gradient: nothing was proposed, nothing is committed
            return {"success": False, "grad_norm": grad_norm, "kl_pred": None, "step_scale": 0.0,
                    "kl_realized": None, "controller_time_s": 0.0, "controller_extra_bytes": 0}
        start = time.perf_counter()
        kl_pred, scale, base, forecast_scale, norm = None, 1.0, None, None, None
        self.forecasts = 0
        max_scale = self.max_scale(optimizer)
        if config.mode == "linear":
            with phase("kl_forecast"):
                unit = self.linear_kl(model, optimizer, probe)
                self.forecasts = 1
            scale = self._scale_for(unit, max_scale) if math.isfinite(unit) else 0.0
            kl_pred, forecast_scale = scale**2 * unit, 1.0
        elif config.mode == "probe":
            with phase("kl_forecast"):
                # The s = 0 logits once (kept from the step's forward when it was asked to), then
                # the first forecast at the last committed step's length (s = 1 at the first step).
                base = self.base_logits(model, optimizer, probe, step_logits)
                measure = getattr(optimizer, "proposed_step_norm", None)
                norm = measure() if measure is not None else None
                scale = self.first_scale(norm, max_scale)
                kl_pred = self.kl(model, optimizer, probe, scale, base)
                self.forecasts, forecast_scale = 1, scale
                if math.isfinite(kl_pred):
                    first = scale
                    scale = self._scale_for(kl_pred, max_scale, at=first)
                    if self.in_band(kl_pred, first, max_scale) or self.rescalable(kl_pred, first, scale,
                                                                                 max_scale):
                        # Accepted without a second forecast, re-centred on the budget along the
                        # growth exponent: in the band (a correction of at most a tolerance's
                        # root), or where the KL at the new scale is within the tolerance of the
                        # budget whatever the exponent (rescalable). A regime that drifts slowly
                        # does not walk the next warm start out of the band, and a step whose D
                        # grew or shrank a little costs one forecast, not two.
                        kl_pred = self._grown(kl_pred, first, scale) if kl_pred > 0 else kl_pred
                    else:
                        scale, kl_pred, forecast_scale = self._refine(model, optimizer, probe, scale, first,
                                                                      kl_pred, base, max_scale)
        if kl_pred is not None and not math.isfinite(kl_pred):
            # A non-finite forecast (agreed by every rank): the step is skipped, nothing committed.
            optimizer.discard()
            return {"success": False, "grad_norm": grad_norm, "kl_pred": kl_pred, "step_scale": 0.0,
                    "kl_realized": None, "controller_time_s": time.perf_counter() - start,
                    "controller_extra_bytes": 0}
        kl_realized = None
        if measure_realized:
            with phase("kl_realized"):
                if held_out is not None:
                    held_base = step_logits.base(held_out) if step_logits is not None else None
                    kl_realized = self.kl(model, optimizer, held_out, scale, held_base)
                else:  # on the probe itself: its s = 0 logits serve again
                    if base is None and step_logits is not None:
                        base = step_logits.base(probe)
                    kl_realized = self.kl(model, optimizer, probe, scale, base)
        del base
        extra = optimizer.extra_bytes()
        overhead = time.perf_counter() - start
        optimizer.commit(scale)
        if config.mode == "probe":
            self.settled_scale = scale
            self.settled_length = None if norm is None else scale * norm
        return {"success": success, "grad_norm": grad_norm, "kl_pred": kl_pred, "step_scale": scale,
                "kl_realized": kl_realized, "controller_time_s": overhead, "controller_extra_bytes": extra,
                "kl_pred_forecast_scale": forecast_scale}


def _schedule_text(schedule: dict) -> str:
    if schedule.get("shape") == "constant":
        return f"constant {schedule.get('start')}"
    return (f"{schedule.get('shape')} {schedule.get('start')} -> {schedule.get('final')} over "
            f"{schedule.get('decay_iters')} iterations")
