"""SketchSpaceOptimizer: the sketched weights' optimizer, a Megatron-Core ``MegatronOptimizer``.

Its "gradient" is the flat sketch buffer the backward writes (the sketched weights take no
dense gradient); it is one part of :class:`~logra_megatron.logra.optimizer.LogRAOptimizer`, a
``ChainedOptimizer`` whose other parts are Megatron's own optimizers of the dense remainder.

A step, in Megatron's phases:
1. ``prepare_grads``: sketches (this rank's TP shards, accumulated over microbatches by the
   backward) are reduced over data parallel: all-reduced, or in ZeRO-1 mode reduce-scattered so
   each DP rank owns a slice of the flat sketch buffer and of the update rule's state
   (:mod:`~logra_megatron.logra.sketch_buffer`; docs/ALGORITHM.md, "DP reduction and ZeRO-1"),
   bucket by bucket during the backward with ``--overlap-grad-reduce``. True when a sketch holds
   an inf or NaN on any rank.
2. ``get_grad_norm``: the sketch part of the global norm (sketch shards are never TP-replicated,
   so their squares are summed over the model-parallel group, and over DP slices in ZeRO-1 mode;
   docs/ALGORITHM.md, "Exactness across TP"). With ``--logra-norm-probes k`` it is completed by
   an unbiased estimate of the gradient outside the sketch (:mod:`~logra_megatron.logra.grad_norm`),
   so clipping acts on an estimate of the full gradient norm. The chain adds the dense part's.
3. ``propose_update``: the update rule (:mod:`~logra_megatron.logra.update_rules`) computes the
   low-rank update ``U`` (gathered over DP in ZeRO-1 mode); ``commit(scale)`` gives each weight
   decoupled weight decay and ``W -= scale * lr * P U`` (left) or ``W -= scale * lr * U Q^T``
   (right), applied by row blocks through the master mode (:mod:`~logra_megatron.logra.masters`;
   docs/ALGORITHM.md, "Sketch-space Adam", "Master weights"). ``step_with_ready_grads`` is the two.
4. On a refresh step the range-finder samples (reduced over TP and DP) give new projections;
   the rule's state is carried into the new bases (:mod:`~logra_megatron.logra.refresh`;
   docs/ALGORITHM.md, "Refresh"). A rule that redraws its projections (``rowadam``) gets a new
   seeded Rademacher projection before every backward instead (docs/ALGORITHM.md, "RowAdam").

``preview(scale)`` shows ``W + scale * D`` to forward passes through a side path in the sketching
layers, without touching the weights (the KL controller's forecast).
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.optimizer import MegatronOptimizer

from logra_megatron import parallel
from logra_megatron.logra.commit_log import Commit, CommitLog
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.grad_norm import GradNormEstimator
from logra_megatron.logra.masters import MasterWeights
from logra_megatron.logra.refresh import REDRAW, RademacherRedraw, RangeFinderRefresh
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.logra.sketch_buffer import LINE, SketchBuffer
from logra_megatron.logra.sketch_overlap import install_no_sync
from logra_megatron.logra.update_rules import UPDATE_RULES
from logra_megatron.models.build import unwrap_model
from logra_megatron.models.weights import gather_full
from logra_megatron.platform.phases import phase


@dataclass
class Proposal:
    """A computed, not yet applied, step of the sketched weights."""

    update: torch.Tensor
    """The low-rank update ``U``, flat and full length (laid out like the sketch buffer)."""
    lr: float
    weight_decay: float
    refresh: bool
    """The step's backward collected range-finder samples: refresh after committing."""


class _SketchSpaceGroups:
    """What ``MegatronOptimizer`` reads as its ``optimizer``: one param group for the sketch space
    (no parameters: the sketched weights take no dense gradient), which Megatron's
    ``OptimizerParamScheduler`` drives like the dense groups; the rule's state is its own."""

    def __init__(self, group: dict):
        self.param_groups = [group]
        self.state: dict = {}


class SketchSpaceOptimizer(MegatronOptimizer):
    """The sketched weights of ``model_chunks`` (Megatron DDP-wrapped models built with the LoGRA
    layer spec: their sketched weights have ``requires_grad=False`` and so are absent from the
    dense buffers). ``config`` is Megatron's ``OptimizerConfig`` (lr, weight_decay, adam
    betas/eps, clip_grad, use_distributed_optimizer), shared with the dense part;
    ``update_rule`` names an entry of :data:`~logra_megatron.logra.update_rules.UPDATE_RULES`
    (default: ``logra_config.update``)."""

    def __init__(self, model_chunks: List, config, logra_config: LogRAConfig,
                 update_rule: Optional[str] = None):
        group = {"params": [], "lr": config.lr, "weight_decay": config.weight_decay, "wd_mult": 1.0,
                 "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                 "default_config": True, "logra_sketch": True}
        super().__init__(_SketchSpaceGroups(group), config)
        self.is_stub_optimizer = False
        self.logra = logra_config
        self.model_chunks = list(model_chunks)
        # Megatron's --overlap-grad-reduce covers the sketches too: the buffer is cut into buckets
        # of the DDP's --ddp-bucket-size (one bucket without overlap, as Megatron's DDP does),
        # whose all-reduces, or ZeRO-1 reduce-scatters, start during the last microbatch's backward
        # (logra/sketch_overlap.py).
        ddp_config = getattr(self.model_chunks[0], "ddp_config", None)
        overlap = ddp_config is not None and ddp_config.overlap_grad_reduce
        self.sketch_buffer = SketchBuffer([unwrap_model(chunk) for chunk in self.model_chunks], logra_config,
                                          bucket_numel=ddp_config.bucket_size if overlap else None)
        if overlap and self.sketch_buffer.overlap_with_backward():
            install_no_sync(self.model_chunks, self.sketch_buffer.overlap)
        name = update_rule or logra_config.update
        rule = UPDATE_RULES.get(name)
        declares = UPDATE_RULES.entry(name).options is not None
        options = (replace(logra_config, update=name).rule_options(),) if declares else ()
        self.update_rule = rule(self.sketch_buffer, config, logra_config, *options)
        redraw = self.update_rule.projections == REDRAW
        self.refresh = (RademacherRedraw if redraw else RangeFinderRefresh)(logra_config, self.sketch_buffer)
        self.masters = MasterWeights(self.sketch_buffer.weights, logra_config.master, logra_config.seed,
                                     shard_over_dp=logra_config.zero1)
        self.norm_estimator = None
        # A Rademacher sketch's norm is itself an unbiased estimate of the gradient's norm
        # (E[Q Q^T] = I for its projection Q); the probes' residual assumes an orthonormal Q.
        if logra_config.norm_probes and not logra_config.identity_projection and not redraw:
            self.norm_estimator = GradNormEstimator(self.sketch_buffer, logra_config.norm_probes, logra_config.seed)
        self.step_count = 0
        self.grads: Optional[torch.Tensor] = None
        """The reduced sketch this rank updates from (after :meth:`prepare_grads`)."""
        self.proposal: Optional[Proposal] = None
        self.commit_log: Optional[CommitLog] = None
        """Committed steps kept for a low-rank policy sync (:meth:`log_commits`); None: none kept."""
        self.last_norms: Dict[str, float] = {}

    @property
    def sketch_group(self) -> dict:
        return self.optimizer.param_groups[0]

    # --- Megatron's contract ----------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1, device=self.sketch_buffer.flat.device)  # bf16/fp32: no loss scaling

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the sketches; arm the norm probes, and on a refresh step the range finder, for
        the coming backward."""
        self.sketch_buffer.zero_()
        with phase("range_finder_arm"):
            self.refresh.arm(self.step_count)
        if self.norm_estimator is not None:
            with phase("norm_probe_draw"):
                self.norm_estimator.arm(self.step_count)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Reduce the sketches (and on a refresh step the range-finder samples); True when the
        reduced sketch holds an inf or NaN on any rank."""
        if self.sketch_buffer.overlap is not None:
            # The DP reduction is in flight on the sketch buffer: let it land before the tied
            # embedding's sum over stages touches the same memory (the two sums commute up to
            # rounding); under ZeRO-1 that sum is of this rank's reduced part of the embedding.
            self.grads = self.sketch_buffer.reduce()
            self.sketch_buffer.reduce_tied(self.grads)
        else:
            self.sketch_buffer.reduce_tied()
            self.grads = self.sketch_buffer.reduce()
        if self.is_refresh_step():
            self.refresh.reduce_samples()
        return self._sketch_not_finite(self.grads)

    def _sketch_not_finite(self, grads: torch.Tensor) -> bool:
        # Computed and reduced on the sketches' device (NCCL reduces no CPU tensor); one host sync.
        flag = (~torch.isfinite(grads).all()).to(torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group())
        if self.sketch_buffer.sliced:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=parallel.dp_group())
        return bool(flag.item() > 0)

    def get_grad_stats_parallel_group(self):
        """The ranks whose sketches make up the whole model's (model-parallel; the world when
        ZeRO-1 slices them over DP, as Megatron's distributed optimizer reports)."""
        return dist.group.WORLD if self.sketch_buffer.sliced else parallel_state.get_model_parallel_group()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The sketch's norm, with the estimate of the gradient outside it (``--logra-norm-probes``);
        ``nan`` when that estimate is not finite."""
        sketch_sq = self.sketch_buffer.squared_norm(self.grads)
        residual_sq = self.norm_estimator.residual_squared_norm() if self.norm_estimator else 0.0
        self.last_norms = {"sketch_sq": sketch_sq, "residual_sq": residual_sq}
        return math.sqrt(sketch_sq + residual_sq) if math.isfinite(residual_sq) else float("nan")

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        coefficient = clip_grad / (grad_norm + 1e-6)
        if coefficient < 1.0:
            self.clip_by(coefficient)
        return grad_norm

    def clip_by(self, coefficient: float) -> None:
        self.grads.mul_(coefficient)

    @torch.no_grad()
    def count_zeros(self) -> float:
        """Zeros in the reduced sketch over the whole model (each slice once)."""
        zeros = (self.grads == 0).sum().to(torch.float32).reshape(1)
        dist.all_reduce(zeros, group=parallel_state.get_model_parallel_group())
        if self.sketch_buffer.sliced:
            dist.all_reduce(zeros, group=parallel.dp_group())
        return float(zeros)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.propose_update()
        self.commit(1.0)
        return True

    @torch.no_grad()
    def step(self):
        """Megatron's step on the sketch space alone (the chain steps the whole model)."""
        if self.prepare_grads():
            self.proposal = None
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0 else self.get_grad_norm()
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def reload_model_params(self, state_dict=None) -> None:
        """Re-sync every master copy from the model's weights (after they were loaded from a
        checkpoint that holds no optimizer state)."""
        self.masters.reload_from_weights()
        if self.commit_log is not None:
            self.commit_log.invalidate()

    def reset_state(self) -> None:
        """Forget the rule's history and the step count (so the next step also refreshes the
        projections); weights and projections are kept."""
        self.update_rule.reset()
        self.step_count = 0

    def is_refresh_step(self) -> bool:
        return self.refresh.is_refresh_step(self.step_count)

    # --- the KL controller's protocol ---------------------------------------------------------------

    @torch.no_grad()
    def propose_update(self) -> None:
        """The update rule's ``U`` from the prepared (clipped) sketch; no weight changes."""
        lr, weight_decay = self.sketch_group["lr"], self.sketch_group["weight_decay"]
        with phase("update_rule"):
            update = self.sketch_buffer.full(self.update_rule.update(self.grads, lr, weight_decay, self.step_count + 1))
            if update is self.grads or update.data_ptr() == self.sketch_buffer.flat.data_ptr():
                update = update.clone()  # the sketch buffer is cleared before the next backward
        self.proposal = Proposal(update, lr, weight_decay, self.is_refresh_step())

    def preview(self, scale: float) -> None:
        """Forward passes see ``W + scale * D`` of the proposed step (``scale = 0``: ``W``)
        through the layers' side path."""
        proposal = self.proposal
        for entry in self.sketch_buffer.weights:
            entry.sketch.preview = None if scale == 0 or proposal is None else (
                scale * proposal.lr, proposal.weight_decay, entry.view(proposal.update))

    @torch.no_grad()
    def commit(self, scale: float) -> None:
        """Apply ``scale`` times the proposed step, then refresh the projections if due."""
        proposal = self.proposal
        for entry in self.sketch_buffer.weights:
            entry.sketch.preview = None
        with phase("commit"):
            self.masters.apply(proposal.update, scale * proposal.lr, proposal.weight_decay, self.step_count)
            if self.commit_log is not None:
                self.commit_log.record(Commit(proposal.update, scale * proposal.lr, proposal.weight_decay,
                                              proposal.refresh))
        if proposal.refresh:
            with phase("range_finder"):
                self.refresh.refresh(self.update_rule)
        self.proposal = None
        self.step_count += 1

    def discard(self) -> None:
        """Drop the proposed step: no weight, master or counter changes (the moments advanced by
        this step's gradient stay, as they do in :meth:`commit`, whatever the scale)."""
        for entry in self.sketch_buffer.weights:
            entry.sketch.preview = None
        self.proposal = None

    def log_commits(self, limit: int) -> None:
        """Keep every committed step from now on (at most ``limit`` between two takes) for a
        rollout engine that replays them (:mod:`~logra_megatron.logra.commit_log`)."""
        self.commit_log = CommitLog(limit)

    @property
    def redraws_projections(self) -> bool:
        """The projections change before every backward (``rowadam``): no committed step can be
        replayed under the projections of the last sync."""
        return isinstance(self.refresh, RademacherRedraw)

    @property
    def kl_max_scale(self) -> float:
        """The KL controller's step-scale cap when ``--kl-max-scale`` is not given: the update
        rule's (1 for ``adam``, 3 for ``rowadam``)."""
        return self.update_rule.kl_max_scale

    def state_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds: the sketch buffer and norm probes (gradients), the update
        rule's state slices, the fp32 masters and the projections."""
        rule_bytes = sum(t.numel() * t.element_size() for t in self.update_rule.state().values())
        probe_bytes = self.norm_estimator.state_bytes() if self.norm_estimator else 0
        return {"grad_bytes": self.sketch_buffer.grad_bytes() + probe_bytes,
                "optimizer_state_bytes": rule_bytes,
                "master_weight_bytes": self.masters.state_bytes(),
                "projection_bytes": self.sketch_buffer.projection_bytes()}

    # --- inspection ------------------------------------------------------------------------------

    @property
    def weights(self):
        """The sketched weights' bookkeeping (:class:`~logra_megatron.logra.sketch_buffer.SketchedWeight`)."""
        return self.sketch_buffer.weights

    @property
    def refreshes_done(self) -> int:
        return self.refresh.refreshes_done

    def sketches(self) -> dict:
        """This rank's current sketches by global weight name (views, not copies)."""
        return self.sketch_buffer.sketches()

    def projections(self) -> dict:
        return self.sketch_buffer.projections()

    # --- checkpointing ---------------------------------------------------------------------------

    def _counters(self) -> dict:
        return dict(step_count=self.step_count, **self.update_rule.counters(),
                    refreshes_done=self.refresh.refreshes_done)

    def _rule_view(self, entry, flat: torch.Tensor) -> torch.Tensor:
        """``entry``'s part of a full-length tensor of the rule's state: shaped like its sketch
        (per-element state) or its lines (per-line state)."""
        return entry.line_view(flat) if self.update_rule.state_layout == LINE else entry.view(flat)

    def _rule_numel(self) -> int:
        return self.sketch_buffer.line_numel if self.update_rule.state_layout == LINE else self.sketch_buffer.numel

    def _full_rule_state(self) -> dict:
        """The rule's state tensors at full length (gathered over DP for sliced per-element
        state; per-line state is never sliced)."""
        state = self.update_rule.state()
        if self.update_rule.state_layout == LINE:
            return dict(state)
        return {name: self.sketch_buffer.full(tensor) for name, tensor in state.items()}

    def _per_weight_state(self) -> dict:
        """Per weight: the rule's state (full, gathered over DP in ZeRO-1 mode) and the
        projection, as copies."""
        full = self._full_rule_state()
        per_weight = {}
        for entry in self.sketch_buffer.weights:
            saved = {name: self._rule_view(entry, tensor).clone() for name, tensor in full.items()}
            saved["projection"] = entry.sketch.projection.clone()
            if self.masters.mode == "fp32":
                saved["master"] = self.masters.full_master(entry)
            per_weight[entry.name] = saved
        return per_weight

    def _saved_state_names(self) -> tuple:
        """Per-weight tensors split like the sketch: the rule's state, and fp32 masters."""
        return self.update_rule.state_names + (("master",) if self.masters.mode == "fp32" else ())

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """For ``dist_checkpointing``: the sketch-space state as ``ShardedTensor``s keyed by global weight name, so it reshards across TP and PP.

        A state tensor of the update rule is split over TP exactly like its weight's sketch
        (rows for right sketches, columns for left ones; the SwiGLU fc1 halves as two tensors;
        per-line state along its only axis, which holds those rows or columns),
        and so is an fp32 master (``--logra-master fp32``: it is split like its weight, which
        is the same axis). Projections are the same on every TP/DP rank and are saved once.
        Embedding and output weights (``--logra-embeddings``) have a vocabulary padded to a
        TP-dependent size: their per-row state is gathered over TP, cut to the real
        vocabulary and saved once, so it reshards to any TP.
        """
        tp_rank, tp_size, dp_rank = parallel.tp_rank(), parallel.tp_size(), parallel.dp_rank()
        per_weight = self._per_weight_state()
        sharded = {}
        for entry in self.sketch_buffer.weights:
            saved = per_weight[entry.name]
            key = f"logra.{entry.name}"
            copy = int(entry.pipeline_copy)
            for state_name in self._saved_state_names():
                tensor = saved[state_name]
                axis = 0 if entry.sketch.side == RIGHT or tensor.dim() == 1 else 1
                if entry.vocab_rows is not None:
                    full = gather_full(tensor, entry.weight, entry.name)[:entry.vocab_rows].contiguous()
                    sharded[f"{entry.name}.{state_name}"] = ShardedTensor.from_rank_offsets(
                        f"{key}.{state_name}", full, replica_id=(copy, tp_rank, dp_rank))
                    continue
                parts = torch.chunk(tensor, 2, dim=0) if entry.is_swiglu_fc1 else (tensor,)
                for index, part in enumerate(parts):
                    suffix = f".half{index}" if entry.is_swiglu_fc1 else ""
                    sharded[f"{entry.name}.{state_name}{suffix}"] = ShardedTensor.from_rank_offsets(
                        f"{key}.{state_name}{suffix}", part.contiguous(), (axis, tp_rank, tp_size),
                        replica_id=dp_rank)
            sharded[f"{entry.name}.projection"] = ShardedTensor.from_rank_offsets(
                f"{key}.projection", saved["projection"], replica_id=(copy, tp_rank, dp_rank))
        return {
            "logra_tensors": sharded,
            "logra_counters": self._counters(),
            "sketch_group": {k: v for k, v in self.sketch_group.items() if k != "params"},
        }

    def state_dict(self) -> dict:
        """This rank's part of :meth:`sharded_state_dict` as plain tensors (Megatron's per-rank
        ``torch`` checkpoint format); :meth:`load_state_dict` takes it back at the same layout."""
        state = self.sharded_state_dict(None)
        state["logra_tensors"] = {name: tensor.data for name, tensor in state["logra_tensors"].items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`
        (or from :meth:`state_dict`)."""
        tensors = state["logra_tensors"]
        names = self.update_rule.state_names
        device = self.sketch_buffer.flat.device
        full = {name: torch.zeros(self._rule_numel(), device=device) for name in names}
        for entry in self.sketch_buffer.weights:
            for name in names:
                self._rule_view(entry, full[name]).copy_(self._loaded(tensors, entry, name))
            entry.sketch.projection = tensors[f"{entry.name}.projection"].to(device=device, dtype=torch.float32,
                                                                              copy=True).contiguous()
            if self.masters.mode == "fp32":
                self.masters.load_full_master(entry, self._loaded(tensors, entry, "master"))
        for name, tensor in self.update_rule.state().items():
            tensor.copy_(full[name] if self.update_rule.state_layout == LINE
                         else self.sketch_buffer.local_slice(full[name]))
        counters = state["logra_counters"]
        self.step_count = int(counters["step_count"])
        self.update_rule.load_counters(counters)
        self.refresh.refreshes_done = int(counters["refreshes_done"])
        self.sketch_group.update(state.get("sketch_group", {}))
        if self.commit_log is not None:  # new weights and projections: no step replays onto them
            self.commit_log.invalidate()

    @staticmethod
    def _loaded(tensors: dict, entry, name: str) -> torch.Tensor:
        """A loaded per-weight tensor as this rank holds it: its SwiGLU halves joined, or its
        vocabulary block cut from the saved real-vocabulary rows."""
        if entry.vocab_rows is not None:
            full = tensors[f"{entry.name}.{name}"]
            local = entry.shape[0] if name != "master" else entry.weight.shape[0]
            start = parallel.tp_rank() * local
            block = full.new_zeros((local,) + tuple(full.shape[1:]))
            rows = full[start:start + local]
            block[:rows.shape[0]] = rows
            return block
        if entry.is_swiglu_fc1:
            return torch.cat([tensors[f"{entry.name}.{name}.half0"], tensors[f"{entry.name}.{name}.half1"]], dim=0)
        return tensors[f"{entry.name}.{name}"]
