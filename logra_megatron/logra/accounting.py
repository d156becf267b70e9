"""Training-state accounting: bytes of gradients, optimizer states, master weights and
projections, and data-parallel communication per step, dense Adam vs LoGRA, for a built model.

Two views:
- :func:`state_bytes` counts from the model's shapes what each optimizer *would* hold (works
  for a model built with either spec; used for reports and summaries).
- ``optimizer.state_bytes()`` (the training optimizer protocol, logra_megatron/training/
  optimizer.py) sums the tensors an optimizer actually allocated (used by the benchmark, next
  to the process's peak memory, and by the trainer's metrics).

Conventions (Megatron's): gradients are reduced and stored in fp32 (``grad_reduce_in_fp32``);
Adam holds two fp32 moments; fp32 master weights exist only when parameters are bf16/fp16.
Counts are per rank (this rank's TP/PP shard).
"""

from dataclasses import asdict, dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch import LEFT, RIGHT, LinearSketch

SKETCHED_SLOTS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
FP32 = 4


@dataclass
class StateBytes:
    """Bytes of training state on one rank (beyond the model weights themselves)."""

    grad_bytes: int
    optimizer_state_bytes: int
    master_weight_bytes: int
    projection_bytes: int
    dp_comm_bytes_per_step: int

    @property
    def total(self) -> int:
        return self.grad_bytes + self.optimizer_state_bytes + self.master_weight_bytes + self.projection_bytes

    def to_dict(self) -> dict:
        return dict(asdict(self), total_bytes=self.total)


def _sketchable(model):
    """``(name, module, side)`` for the decoder linears LoGRA sketches, whichever spec built them."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in SKETCHED_SLOTS or ".layers." not in f".{name}":
            continue
        if isinstance(module, ColumnParallelLinear):
            found.append((name, module, RIGHT))
        elif isinstance(module, RowParallelLinear):
            found.append((name, module, LEFT))
    return found


def state_bytes(model, logra_config: LogRAConfig) -> dict:
    """``{"dense": StateBytes, "logra": StateBytes}`` for this rank's part of ``model``."""
    sketchable = {id(module.weight): (name, module, side) for name, module, side in _sketchable(model)}
    master = 0 if next(model.parameters()).dtype == torch.float32 else FP32
    all_numel = dense_remainder = sketch_numel = projection_numel = 0
    for param in model.parameters():
        all_numel += param.numel()
        if id(param) not in sketchable:
            dense_remainder += param.numel()
    for name, module, side in sketchable.values():
        out_features, in_features = module.weight.shape
        projected = in_features if side == RIGHT else out_features
        rank = projected if logra_config.identity_projection else logra_config.rank_for(projected, name)
        sketch_numel += LinearSketch.sketch_shape(side, out_features, in_features, rank)[0] * \
            LinearSketch.sketch_shape(side, out_features, in_features, rank)[1]
        projection_numel += projected * rank
    dense = StateBytes(
        grad_bytes=all_numel * FP32, optimizer_state_bytes=2 * all_numel * FP32,
        master_weight_bytes=all_numel * master, projection_bytes=0,
        dp_comm_bytes_per_step=all_numel * FP32)
    logra = StateBytes(
        grad_bytes=(dense_remainder + sketch_numel) * FP32,
        optimizer_state_bytes=2 * (dense_remainder + sketch_numel) * FP32,
        master_weight_bytes=dense_remainder * master, projection_bytes=projection_numel * FP32,
        dp_comm_bytes_per_step=(dense_remainder + sketch_numel) * FP32)
    return {"dense": dense, "logra": logra}

