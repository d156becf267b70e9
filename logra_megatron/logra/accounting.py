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

from dataclasses import asdict, dataclass, replace

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from logra_megatron.logra import update_memory
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch_memory import FP32, LEFT, RIGHT, SketchedWeight

SKETCHED_SLOTS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


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


def _sketchable(model, logra_config: LogRAConfig):
    """``(name, module, side)`` for the weights LoGRA sketches, whichever spec built the model:
    the decoder linears, and with ``--logra-embeddings`` the word embedding and an output layer
    that owns a weight."""
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if logra_config.embeddings and name.endswith("word_embeddings"):
            found.append((name, module, RIGHT))
        elif logra_config.embeddings and name == "output_layer" and module.weight is not None:
            found.append((name, module, RIGHT))
        elif leaf not in SKETCHED_SLOTS or ".layers." not in f".{name}":
            continue
        elif isinstance(module, ColumnParallelLinear):
            found.append((name, module, RIGHT))
        elif isinstance(module, RowParallelLinear):
            found.append((name, module, LEFT))
    return found


def state_bytes(model, logra_config: LogRAConfig) -> dict:
    """``{"dense": StateBytes, "logra": StateBytes}`` for this rank's part of ``model``.

    LoGRA's gradients are the sketches plus the norm probes' samples (``k`` columns or rows per
    sketched weight, for a rule that has them), its optimizer state the dense remainder's Adam
    moments and what the update rule declares (logra/update_memory.py), its masters the fp32
    copies of sketched weights when the weights are low precision and ``--logra-master fp32``."""
    sketchable = {id(module.weight): (name, module, side) for name, module, side in _sketchable(model, logra_config)}
    master = 0 if next(model.parameters()).dtype == torch.float32 else FP32
    all_numel = dense_remainder = sketched_numel = sketch_numel = projection_numel = probe_numel = 0
    for param in model.parameters():
        all_numel += param.numel()
        if id(param) not in sketchable:
            dense_remainder += param.numel()
    rule = update_memory.declared_memory(logra_config.update)
    uses_probes = not logra_config.identity_projection and update_memory.uses_norm_probes(rule)
    probes = logra_config.norm_probes if uses_probes else 0
    lines = 0
    for name, module, side in sketchable.values():
        unranked = SketchedWeight(side, *module.weight.shape, rank=0)
        weight = replace(unranked, rank=logra_config.sketch_rank(unranked.projected_dim, name))
        sketch_numel += weight.sketch_numel
        projection_numel += weight.projection_numel
        probe_numel += weight.probe_sample_numel(probes)
        lines += weight.lines
        sketched_numel += weight.master_numel()
    sketched_master = master if logra_config.master == "fp32" else 0
    dense = StateBytes(
        grad_bytes=all_numel * FP32, optimizer_state_bytes=2 * all_numel * FP32,
        master_weight_bytes=all_numel * master, projection_bytes=0,
        dp_comm_bytes_per_step=all_numel * FP32)
    logra = StateBytes(
        grad_bytes=(dense_remainder + sketch_numel + probe_numel) * FP32,
        # the dense remainder's Adam moments, and the update rule's state as the rule declares it
        optimizer_state_bytes=2 * dense_remainder * FP32 + update_memory.state_bytes(rule, sketch_numel, lines),
        master_weight_bytes=dense_remainder * master + sketched_numel * sketched_master,
        projection_bytes=projection_numel * FP32,
        dp_comm_bytes_per_step=(dense_remainder + sketch_numel + probe_numel) * FP32)
    return {"dense": dense, "logra": logra}
