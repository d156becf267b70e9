"""One optimizer object: a sketch-space update rule (AdamW by default) for sketched weights, a
dense Megatron optimizer for the remainder, one gradient norm, one clipping, one LR schedule, one
checkpoint.

A step:
1. Sketches (this rank's TP shards, accumulated over microbatches by the backward) are reduced
   over data parallel: all-reduced, or in ZeRO-1 mode reduce-scattered so each DP rank owns a
   slice of the flat sketch buffer and of the update rule's state
   (:mod:`~logra_megatron.logra.sketch_buffer`; docs/ALGORITHM.md, "DP reduction and ZeRO-1").
2. The global gradient norm combines the dense norm (TP duplicates counted once) with the
   sketch norm (sketch shards are never TP-replicated, so their squares are summed over the
   model-parallel group, and over DP slices in ZeRO-1 mode); both parts are clipped by it
   (docs/ALGORITHM.md, "Exactness across TP").
3. The dense optimizer steps the remainder; the update rule (:mod:`~logra_megatron.logra.update_rules`)
   computes the low-rank update ``U`` (gathered over DP in ZeRO-1 mode), and each weight gets
   decoupled weight decay and ``W -= lr * P U`` (left) or ``W -= lr * U Q^T`` (right)
   (docs/ALGORITHM.md, "Sketch-space Adam").
4. On a refresh step the range-finder samples (reduced over TP and DP) give new projections;
   the rule's state is carried into the new bases (:mod:`~logra_megatron.logra.refresh`;
   docs/ALGORITHM.md, "Refresh").

The dense part is injected (``dense``): an adapter around Megatron's optimizer that offers the
phases of Megatron's step separately (:class:`DenseRemainder`); the training layer's registry
builds it, so this package never imports the training layer.
"""

import math
from typing import Dict, List, Protocol

import torch
from megatron.core.dist_checkpointing import ShardedTensor

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.refresh import RangeFinderRefresh
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.logra.sketch_buffer import SketchBuffer
from logra_megatron.logra.update_rules import UPDATE_RULES
from logra_megatron.models.build import unwrap_model


class DenseRemainder(Protocol):
    """What LogRAOptimizer needs of the optimizer of the dense (unsketched) parameters: the
    training optimizer interface plus Megatron's step split into its phases."""

    @property
    def param_groups(self) -> List[dict]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def prepare_grads(self) -> bool:
        """Copy/unscale the gradients for the step; True when they contain an inf or NaN."""

    def grad_norm(self) -> float:
        """The dense gradients' global norm (TP duplicates counted once); 0.0 when there are none."""

    def clip_grads(self, max_norm: float, total_norm: float) -> None:
        """Scale the dense gradients by ``max_norm / total_norm`` when that is below 1."""

    def step_with_ready_grads(self) -> bool: ...

    def reset_state(self) -> None: ...

    def state_bytes(self) -> Dict[str, int]: ...

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict: ...

    def load_state_dict(self, state) -> None: ...

    def reload_model_params(self) -> None: ...


class LogRAOptimizer:
    """The training optimizer over sketched weights plus an injected dense optimizer.

    ``model_chunks`` are Megatron DDP-wrapped models built with the LoGRA layer spec (their
    sketched weights have ``requires_grad=False`` and so are absent from the dense buffers).
    ``optimizer_config`` is Megatron's ``OptimizerConfig`` (lr, weight_decay, adam betas/eps,
    clip_grad, use_distributed_optimizer), shared by both parts; ``dense`` steps the parameters
    that are not sketched (see :class:`DenseRemainder`); ``update_rule`` names an entry of
    :data:`~logra_megatron.logra.update_rules.UPDATE_RULES`.
    """

    def __init__(self, model_chunks: List, optimizer_config, logra_config: LogRAConfig,
                 dense: DenseRemainder, update_rule: str = "adam"):
        if len(model_chunks) != 1:
            raise ValueError("LogRAOptimizer supports one model chunk (no virtual pipeline)")
        self.config = optimizer_config
        self.logra = logra_config
        self.model_chunks = model_chunks
        self.dense = dense
        self.sketch_buffer = SketchBuffer(unwrap_model(model_chunks[0]), logra_config)
        self.update_rule = UPDATE_RULES[update_rule](self.sketch_buffer.slice_numel, optimizer_config, logra_config)
        self.refresh = RangeFinderRefresh(logra_config, self.sketch_buffer)
        self.step_count = 0
        dense_group = self.dense.param_groups[0]
        self.sketch_group = {
            key: value for key, value in dense_group.items() if key not in ("params",)
        }
        self.sketch_group.update(params=[], lr=optimizer_config.lr, weight_decay=optimizer_config.weight_decay,
                                 wd_mult=1.0, lr_mult=1.0, logra_sketch=True)

    # --- the training optimizer interface -------------------------------------------------------

    @property
    def param_groups(self) -> List[dict]:
        """Dense groups plus one group for the sketch space, so Megatron's
        OptimizerParamScheduler sets one learning rate and weight decay for both."""
        return list(self.dense.param_groups) + [self.sketch_group]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def reload_model_params(self) -> None:
        """Re-sync the dense optimizer's master copies from the model (after weights were set
        from outside, e.g. by the KL controller). Sketched weights have no master copy."""
        self.dense.reload_model_params()

    def reset_state(self) -> None:
        """Forget the optimizer's history (the update rule's state, the dense moments and the
        step count, so the next step also refreshes the projections): a new training phase
        starts from a clean state. Weights and projections are kept."""
        self.update_rule.reset()
        self.step_count = 0
        self.dense.reset_state()

    def is_refresh_step(self) -> bool:
        return self.refresh.is_refresh_step(self.step_count)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense grads and sketches; on a refresh step, arm the range finder."""
        self.dense.zero_grad(set_to_none)
        self.sketch_buffer.zero_()
        self.refresh.arm(self.step_count)

    @torch.no_grad()
    def step(self):
        """Returns ``(success, grad_norm, num_zeros)`` like Megatron's optimizers."""
        refresh = self.is_refresh_step()
        if refresh:
            self.refresh.reduce_samples()
        grads = self.sketch_buffer.reduce()
        found_inf = self.dense.prepare_grads()
        if found_inf:
            return False, None, None
        dense_norm = self.dense.grad_norm()
        grad_norm = math.sqrt(dense_norm**2 + self.sketch_buffer.squared_norm(grads))
        clip = self.config.clip_grad
        if clip > 0.0:
            self.dense.clip_grads(clip, grad_norm)
            coefficient = clip / (grad_norm + 1e-6)
            if coefficient < 1.0:
                grads.mul_(coefficient)
        success = self.dense.step_with_ready_grads()
        lr, weight_decay = self.sketch_group["lr"], self.sketch_group["weight_decay"]
        update = self.update_rule.update(grads, lr, weight_decay, self.step_count + 1)
        self._apply(self.sketch_buffer.full(update), lr, weight_decay)
        if refresh:
            self.refresh.refresh(self.update_rule)
        self.step_count += 1
        return success, grad_norm, None

    def _apply(self, update: torch.Tensor, lr: float, weight_decay: float) -> None:
        """Decoupled weight decay and the low-rank update mapped back to every weight shard."""
        for entry in self.sketch_buffer.weights:
            weight = entry.weight
            low_rank = entry.view(update)
            if weight_decay != 0.0:
                weight.mul_(1 - lr * weight_decay)
            weight.add_(entry.sketch.update_from(low_rank).to(weight.dtype), alpha=-lr)

    def state_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds: the dense part's plus the sketch buffer (gradients), the
        update rule's state slices and the projections."""
        dense = self.dense.state_bytes()
        rule_bytes = sum(t.numel() * t.element_size() for t in self.update_rule.state().values())
        return {"grad_bytes": dense["grad_bytes"] + self.sketch_buffer.grad_bytes(),
                "optimizer_state_bytes": dense["optimizer_state_bytes"] + rule_bytes,
                "master_weight_bytes": dense["master_weight_bytes"],
                "projection_bytes": dense["projection_bytes"] + self.sketch_buffer.projection_bytes()}

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

    def _per_weight_state(self) -> dict:
        """Per weight: the rule's state (full, gathered over DP in ZeRO-1 mode) and the
        projection, as copies."""
        full = {name: self.sketch_buffer.full(tensor) for name, tensor in self.update_rule.state().items()}
        per_weight = {}
        for entry in self.sketch_buffer.weights:
            saved = {name: entry.view(tensor).clone() for name, tensor in full.items()}
            saved["projection"] = entry.sketch.projection.clone()
            per_weight[entry.name] = saved
        return per_weight

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """For ``dist_checkpointing``: the dense optimizer's state plus the sketch-space state as
        ``ShardedTensor``s keyed by global weight name, so it reshards across TP and PP.

        A state tensor of the update rule is split over TP exactly like its weight's sketch
        (rows for right sketches, columns for left ones; the SwiGLU fc1 halves as two tensors).
        Projections are the same on every TP/DP rank and are saved once.
        """
        tp_rank, tp_size, dp_rank = parallel.tp_rank(), parallel.tp_size(), parallel.dp_rank()
        per_weight = self._per_weight_state()
        sharded = {}
        for entry in self.sketch_buffer.weights:
            saved = per_weight[entry.name]
            key = f"logra.{entry.name}"
            axis = 0 if entry.sketch.side == RIGHT else 1
            for state_name in self.update_rule.state_names:
                tensor = saved[state_name]
                parts = torch.chunk(tensor, 2, dim=0) if entry.is_swiglu_fc1 else (tensor,)
                for index, part in enumerate(parts):
                    suffix = f".half{index}" if entry.is_swiglu_fc1 else ""
                    sharded[f"{entry.name}.{state_name}{suffix}"] = ShardedTensor.from_rank_offsets(
                        f"{key}.{state_name}{suffix}", part.contiguous(), (axis, tp_rank, tp_size),
                        replica_id=dp_rank)
            sharded[f"{entry.name}.projection"] = ShardedTensor.from_rank_offsets(
                f"{key}.projection", saved["projection"], replica_id=(0, tp_rank, dp_rank))
        return {
            "dense": self.dense.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs),
            "logra_tensors": sharded,
            "logra_counters": self._counters(),
            "sketch_group": {k: v for k, v in self.sketch_group.items() if k != "params"},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        self.dense.load_state_dict(state["dense"])
        tensors = state["logra_tensors"]
        names = self.update_rule.state_names
        full = {name: torch.zeros(self.sketch_buffer.numel) for name in names}
        for entry in self.sketch_buffer.weights:
            for name in names:
                if entry.is_swiglu_fc1:
                    saved = torch.cat([tensors[f"{entry.name}.{name}.half0"],
                                       tensors[f"{entry.name}.{name}.half1"]], dim=0)
                else:
                    saved = tensors[f"{entry.name}.{name}"]
                entry.view(full[name]).copy_(saved)
            entry.sketch.projection = tensors[f"{entry.name}.projection"].float().contiguous().clone()
        for name, tensor in self.update_rule.state().items():
            tensor.copy_(self.sketch_buffer.local_slice(full[name]))
        counters = state["logra_counters"]
        self.step_count = int(counters["step_count"])
        self.update_rule.load_counters(counters)
        self.refresh.refreshes_done = int(counters["refreshes_done"])
        self.sketch_group.update(state.get("sketch_group", {}))
