"""One optimizer object: Adam(W) in sketch space for sketched weights, Megatron's optimizer for
the dense remainder, one gradient norm, one clipping, one LR schedule, one checkpoint.

A step (DESIGN.md section 2):
1. Sketches (this rank's TP shards, accumulated over microbatches by the backward) are reduced
   over data parallel: all-reduced, or in ZeRO-1 mode reduce-scattered so each DP rank owns a
   slice of the flat sketch buffer and of the sketch-space Adam state.
2. The global gradient norm combines Megatron's dense norm (TP duplicates counted once) with
   the sketch norm (sketch shards are never TP-replicated, so their squares are summed over the
   model-parallel group, and over DP slices in ZeRO-1 mode); both parts are clipped by it.
3. Megatron's optimizer steps the dense remainder; sketch-space Adam computes the low-rank
   update ``U`` (gathered over DP in ZeRO-1 mode), and each weight gets decoupled weight decay
   and ``W -= lr * P U`` (left) or ``W -= lr * U Q^T`` (right).
4. On a refresh step the range-finder samples (reduced over TP and DP) give new projections;
   the first moment is rotated into the new basis and the second rotated-and-clamped or reset.

Adam follows torch's AdamW arithmetic exactly, so with the identity projection at full rank it
*is* dense Adam (a test).
"""

import math
from typing import List

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.layers import sketched_modules
from logra_megatron.logra.projection import random_orthonormal, range_finder_basis
from logra_megatron.seeding import name_seed, seeded_gaussian
from logra_megatron.logra.sketch import LEFT, RIGHT, LinearSketch
from logra_megatron.models.weights import global_name, layer_offset, shard_of


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def reset_dense_state(optimizer) -> None:
    """Drop the Adam moments of a Megatron optimizer (chained or not); torch's Adam creates
    them again, zeroed, at the next step."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.optimizer.state.clear()


class _SketchedWeight:
    """Bookkeeping for one sketched weight: its module, sketch, and views into flat buffers."""

    def __init__(self, name: str, local_name: str, module, sketch: LinearSketch, offset: int):
        self.name = name  # global, e.g. decoder.layers.3.mlp.linear_fc1.weight
        self.local_name = local_name
        self.module = module
        self.sketch = sketch
        self.offset = offset  # into the flat sketch buffer
        self.numel = sketch.sketch.numel()
        self.shape = tuple(sketch.sketch.shape)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.module.weight

    @property
    def is_swiglu_fc1(self) -> bool:
        return self.name.endswith("mlp.linear_fc1.weight")

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


class LogRAOptimizer:
    """Megatron optimizer interface over sketched weights plus a dense Megatron optimizer.

    ``model_chunks`` are Megatron DDP-wrapped models built with the LoGRA layer spec (their
    sketched weights have ``requires_grad=False`` and so are absent from the dense buffers).
    ``optimizer_config`` is Megatron's ``OptimizerConfig`` (lr, weight_decay, adam betas/eps,
    clip_grad, use_distributed_optimizer) and is shared by both parts.
    """

    def __init__(self, model_chunks: List, optimizer_config, logra_config: LogRAConfig):
        from megatron.core.optimizer import get_megatron_optimizer

        if len(model_chunks) != 1:
            raise ValueError("LogRAOptimizer supports one model chunk (no virtual pipeline)")
        self.config = optimizer_config
        self.logra = logra_config
        self.model_chunks = model_chunks
        self.dense = get_megatron_optimizer(optimizer_config, model_chunks)
        self.zero1 = logra_config.zero1
        self.dp = parallel.dp_size()
        self._build_sketches(_unwrap(model_chunks[0]))
        self.step_count = 0
        self.second_moment_steps = 0
        self.refreshes_done = 0
        dense_group = self.dense.param_groups[0]
        self.sketch_group = {
            key: value for key, value in dense_group.items() if key not in ("params",)
        }
        self.sketch_group.update(params=[], lr=optimizer_config.lr, weight_decay=optimizer_config.weight_decay,
                                 wd_mult=1.0, lr_mult=1.0, logra_sketch=True)

    # --- construction ---------------------------------------------------------------------

    def _build_sketches(self, model):
        offset_layers = layer_offset(model)
        entries = []
        total = 0
        for local_name, module in sketched_modules(model):
            name = global_name(local_name, offset_layers) + ".weight"
            out_features, in_features = module.weight.shape
            side = module.sketch_side
            projected = in_features if side == RIGHT else out_features
            rank = self.logra.rank_for(projected, name)
            entries.append((name, local_name, module, side, out_features, in_features, projected, rank, total))
            total += math.prod(LinearSketch.sketch_shape(side, out_features, in_features, rank))
        if not entries:
            raise ValueError("the model has no sketching linears: build it with logra_layer_spec()")
        padded = -(-total // self.dp) * self.dp if self.zero1 else total
        self.sketch_buffer = torch.zeros(padded, dtype=torch.float32)
        self.weights: List[_SketchedWeight] = []
        for name, local_name, module, side, out_f, in_f, projected, rank, offset in entries:
            if self.logra.identity_projection:
                if rank != projected:
                    raise ValueError(f"identity projection needs full rank ({projected}) for {name}")
                projection = torch.eye(projected)
            else:
                projection = random_orthonormal(projected, rank, name_seed(self.logra.seed, name))
            shape = LinearSketch.sketch_shape(side, out_f, in_f, rank)
            view = self.sketch_buffer[offset : offset + math.prod(shape)].view(shape)
            sketch = LinearSketch(name, side, out_f, in_f, projection, view)
            module.logra_sketch = sketch
            self.weights.append(_SketchedWeight(name, local_name, module, sketch, offset))
        state_numel = padded // self.dp if self.zero1 else padded
        self.exp_avg = torch.zeros(state_numel, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(state_numel, dtype=torch.float32)

    # --- Megatron optimizer interface ----------------------------------------------------------

    @property
    def param_groups(self) -> List[dict]:
        """Dense groups plus one group for the sketch-space Adam, so Megatron's
        OptimizerParamScheduler sets one learning rate and weight decay for both."""
        return list(self.dense.param_groups) + [self.sketch_group]

    def get_loss_scale(self):
        return self.dense.get_loss_scale()

    def scale_loss(self, loss):
        return self.dense.scale_loss(loss)

    def reload_model_params(self, state_dict=None):
        """Re-sync the dense optimizer's master copies from the model (after weights were set
        from outside, e.g. by the KL controller). Sketched weights have no master copy."""
        self.dense.reload_model_params(state_dict)

    def reset_state(self) -> None:
        """Forget the optimizer's history (both Adam moments, dense and sketched, and the step
        count, so the next step also refreshes the projections): a new training phase starts
        from a clean state. Weights and projections are kept."""
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step_count = 0
        self.second_moment_steps = 0
        reset_dense_state(self.dense)

    def is_refresh_step(self) -> bool:
        return not self.logra.identity_projection and self.step_count % self.logra.refresh_interval == 0

    def zero_grad(self, set_to_none: bool = True):
        """Clear dense grads and sketches; on a refresh step, arm the range finder."""
        self.dense.zero_grad(set_to_none)
        self.sketch_buffer.zero_()
        refresh = self.is_refresh_step()
        for entry in self.weights:
            sketch = entry.sketch
            if refresh:
                sketch.test_matrix = self._test_matrix(entry)
                rows = sketch.in_features if sketch.side == RIGHT else sketch.out_features
                sketch.range_sample = torch.zeros(rows, sketch.test_matrix.shape[1])
            else:
                sketch.test_matrix = sketch.range_sample = None

    def _test_matrix(self, entry: _SketchedWeight) -> torch.Tensor:
        """This rank's rows of the seeded Gaussian test matrix Omega (full rows: the weight's
        non-projected dimension at TP=1, sharded exactly like the weight)."""
        sketch = entry.sketch
        columns = min(sketch.rank + self.logra.oversampling,
                      sketch.in_features if sketch.side == RIGHT else sketch.out_features)
        seed = name_seed(self.logra.seed, entry.name, 1 + self.refreshes_done)
        weight = entry.weight
        if sketch.side == RIGHT:  # Omega spans the (TP-split) output rows
            full_rows = sketch.out_features * (parallel.tp_size() if weight.tensor_model_parallel else 1)
            return shard_of(seeded_gaussian(full_rows, columns, seed), weight, entry.name).contiguous()
        full_rows = sketch.in_features * (parallel.tp_size() if weight.tensor_model_parallel else 1)
        return shard_of(seeded_gaussian(full_rows, columns, seed).t(), weight, entry.name).t().contiguous()

    @torch.no_grad()
    def step(self):
        """Returns ``(success, grad_norm, num_zeros)`` like Megatron's optimizers."""
        from megatron.core import parallel_state
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        grads = self._reduce_sketches_over_dp()
        found_inf = self.dense.prepare_grads()
        if found_inf:
            return False, None, None
        dense_norm = float(self.dense.get_grad_norm() or 0.0)
        sketch_sq = torch.tensor([float(grads.double().pow(2).sum())], dtype=torch.float64)
        dist.all_reduce(sketch_sq, group=parallel_state.get_model_parallel_group())
        if self.zero1 and self.dp > 1:
            dist.all_reduce(sketch_sq, group=parallel.dp_group())
        grad_norm = math.sqrt(dense_norm**2 + float(sketch_sq))
        clip = self.config.clip_grad
        if clip > 0.0:
            for optimizer in getattr(self.dense, "chained_optimizers", [self.dense]):
                params = optimizer.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, clip, grad_norm)
            coefficient = clip / (grad_norm + 1e-6)
            if coefficient < 1.0:
                grads.mul_(coefficient)
        success = self.dense.step_with_ready_grads()
        self._sketch_adam_step(grads)
        if self.is_refresh_step():
            self._refresh_projections()
        self.step_count += 1
        return success, grad_norm, None

    # --- sketch-space work -------------------------------------------------------------------

    def _reduce_sketches_over_dp(self) -> torch.Tensor:
        """Mean over data-parallel replicas; returns the gradient this rank updates from
        (the whole flat buffer, or its ZeRO-1 slice)."""
        if self.is_refresh_step():
            for entry in self.weights:
                sample = entry.sketch.range_sample
                if parallel.tp_size() > 1:
                    dist.all_reduce(sample, group=parallel.tp_group())
                if self.dp > 1:
                    dist.all_reduce(sample, group=parallel.dp_group())
        if self.dp == 1:
            return self.sketch_buffer if not self.zero1 else self.sketch_buffer.clone()
        if self.zero1:
            shard = torch.empty(self.sketch_buffer.numel() // self.dp)
            dist.reduce_scatter_tensor(shard, self.sketch_buffer, group=parallel.dp_group())
            return shard.div_(self.dp)
        dist.all_reduce(self.sketch_buffer, group=parallel.dp_group())
        return self.sketch_buffer.div_(self.dp)

    def _sketch_adam_step(self, grads: torch.Tensor) -> None:
        group = self.sketch_group
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2, eps = self.config.adam_beta1, self.config.adam_beta2, self.config.adam_eps
        step = self.step_count + 1
        self.second_moment_steps += 1
        self.exp_avg.mul_(beta1).add_(grads, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**self.second_moment_steps
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        update = (self.exp_avg / denom).div_(bias_correction1)
        if self.zero1 and self.dp > 1:
            full = torch.empty(self.sketch_buffer.numel())
            dist.all_gather_into_tensor(full, update, group=parallel.dp_group())
            update = full
        for entry in self.weights:
            weight = entry.weight
            low_rank = entry.view(update)
            if weight_decay != 0.0:
                weight.mul_(1 - lr * weight_decay)
            weight.add_(entry.sketch.update_from(low_rank).to(weight.dtype), alpha=-lr)

    def _full_moments(self):
        """Both Adam moments as full flat buffers (gathered over DP in ZeRO-1 mode)."""
        if not (self.zero1 and self.dp > 1):
            return self.exp_avg, self.exp_avg_sq
        full = []
        for state in (self.exp_avg, self.exp_avg_sq):
            gathered = torch.empty(self.sketch_buffer.numel())
            dist.all_gather_into_tensor(gathered, state, group=parallel.dp_group())
            full.append(gathered)
        return tuple(full)

    def _set_full_moments(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if self.zero1 and self.dp > 1:
            size = self.exp_avg.numel()
            start = parallel.dp_rank() * size
            exp_avg, exp_avg_sq = exp_avg[start : start + size], exp_avg_sq[start : start + size]
        self.exp_avg.copy_(exp_avg)
        self.exp_avg_sq.copy_(exp_avg_sq)

    def _refresh_projections(self) -> None:
        """New bases from the reduced range samples; moments follow them (DESIGN.md section 2)."""
        exp_avg, exp_avg_sq = self._full_moments()
        if exp_avg is self.exp_avg:
            exp_avg, exp_avg_sq = exp_avg.clone(), exp_avg_sq.clone()
        for entry in self.weights:
            sketch = entry.sketch
            old = sketch.projection
            new = range_finder_basis(sketch.range_sample, sketch.rank)
            change = new.t() @ old  # r x r: coordinates of the old basis in the new one
            first, second = entry.view(exp_avg), entry.view(exp_avg_sq)
            # The second moment follows the same change of basis as a variance does: squared
            # coefficients (C o C), which keeps it non-negative and on the first moment's scale.
            if sketch.side == LEFT:  # moments are r x n: M <- C M
                first.copy_(change @ first)
                if self.logra.second_moment == "rotate":
                    second.copy_(change.square() @ second)
            else:  # moments are m x r: M <- M C^T
                first.copy_(first @ change.t())
                if self.logra.second_moment == "rotate":
                    second.copy_(second @ change.square().t())
            sketch.projection = new
            sketch.test_matrix = sketch.range_sample = None
        if self.logra.second_moment == "reset":
            exp_avg_sq.zero_()
            self.second_moment_steps = 0
        self._set_full_moments(exp_avg, exp_avg_sq)
        self.refreshes_done += 1

    # --- inspection ----------------------------------------------------------------------------

    def sketches(self) -> dict:
        """This rank's current sketches by global weight name (views, not copies)."""
        return {entry.name: entry.sketch.sketch for entry in self.weights}

    def projections(self) -> dict:
        return {entry.name: entry.sketch.projection for entry in self.weights}

    # --- checkpointing ---------------------------------------------------------------------------

    def _logra_state(self) -> dict:
        exp_avg, exp_avg_sq = self._full_moments()
        per_weight = {}
        for entry in self.weights:
            per_weight[entry.name] = {
                "exp_avg": entry.view(exp_avg).clone(),
                "exp_avg_sq": entry.view(exp_avg_sq).clone(),
                "projection": entry.sketch.projection.clone(),
            }
        return {
            "weights": per_weight,
            "step_count": self.step_count,
            "second_moment_steps": self.second_moment_steps,
            "refreshes_done": self.refreshes_done,
        }

    def _load_logra_state(self, state: dict) -> None:
        exp_avg, exp_avg_sq = (torch.zeros(self.sketch_buffer.numel()) for _ in range(2))
        for entry in self.weights:
            saved = state["weights"][entry.name]
            entry.view(exp_avg).copy_(saved["exp_avg"])
            entry.view(exp_avg_sq).copy_(saved["exp_avg_sq"])
            entry.sketch.projection = saved["projection"].float().contiguous().clone()
        self._set_full_moments(exp_avg, exp_avg_sq)
        self.step_count = int(state["step_count"])
        self.second_moment_steps = int(state["second_moment_steps"])
        self.refreshes_done = int(state["refreshes_done"])

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "logra": self._logra_state(),
                "sketch_group": {k: v for k, v in self.sketch_group.items() if k != "params"}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.dense.load_state_dict(state_dict["dense"])
        self._load_logra_state(state_dict["logra"])
        self.sketch_group.update(state_dict.get("sketch_group", {}))

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """For ``dist_checkpointing``: Megatron's dense optimizer state plus sketch-space state as
        ``ShardedTensor``s keyed by global weight name, so it reshards across TP and PP.

        A sketch-space moment is split over TP exactly like its weight's sketch (rows for right
        sketches, columns for left ones; the SwiGLU fc1 halves as two tensors). Projections are
        the same on every TP/DP rank and are saved once.
        """
        from megatron.core.dist_checkpointing import ShardedTensor

        tp_rank, tp_size, dp_rank = parallel.tp_rank(), parallel.tp_size(), parallel.dp_rank()
        state = self._logra_state()
        sharded = {}
        for entry in self.weights:
            saved = state["weights"][entry.name]
            key = f"logra.{entry.name}"
            axis = 0 if entry.sketch.side == RIGHT else 1
            for moment in ("exp_avg", "exp_avg_sq"):
                tensor = saved[moment]
                parts = torch.chunk(tensor, 2, dim=0) if entry.is_swiglu_fc1 else (tensor,)
                for index, part in enumerate(parts):
                    suffix = f".half{index}" if entry.is_swiglu_fc1 else ""
                    sharded[f"{entry.name}.{moment}{suffix}"] = ShardedTensor.from_rank_offsets(
                        f"{key}.{moment}{suffix}", part.contiguous(), (axis, tp_rank, tp_size),
                        replica_id=dp_rank)
            sharded[f"{entry.name}.projection"] = ShardedTensor.from_rank_offsets(
                f"{key}.projection", saved["projection"], replica_id=(0, tp_rank, dp_rank))
        return {
            "dense": self.dense.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs),
            "logra_tensors": sharded,
            "logra_counters": {"step_count": state["step_count"],
                               "second_moment_steps": state["second_moment_steps"],
                               "refreshes_done": state["refreshes_done"]},
            "sketch_group": {k: v for k, v in self.sketch_group.items() if k != "params"},
        }

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        self.dense.load_state_dict(loaded["dense"])
        tensors = loaded["logra_tensors"]
        weights = {}
        for entry in self.weights:
            moments = {}
            for moment in ("exp_avg", "exp_avg_sq"):
                if entry.is_swiglu_fc1:
                    moments[moment] = torch.cat([tensors[f"{entry.name}.{moment}.half0"],
                                                 tensors[f"{entry.name}.{moment}.half1"]], dim=0)
                else:
                    moments[moment] = tensors[f"{entry.name}.{moment}"]
            weights[entry.name] = dict(moments, projection=tensors[f"{entry.name}.projection"])
        self._load_logra_state(dict(loaded["logra_counters"], weights=weights))
        self.sketch_group.update(loaded.get("sketch_group", {}))
