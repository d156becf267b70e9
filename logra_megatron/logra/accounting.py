"""Training-state accounting: bytes of gradients, optimizer states, master weights and
projections, and data-parallel communication per step, dense Adam vs LoGRA, for a built model.

Two views:
- :func:`state_bytes` counts from the model's shapes what each optimizer *would* hold (works
  for a model built with either spec; used for reports and summaries).
- ``optimizer.state_bytes()`` (the training optimizer protocol, logra_megatron/training/
  optimizer.py) sums the tensors an optimizer actually allocated (used by the benchmark, next
  to the process's peak memory, and by the trainer's metrics).

Dense Adam's bytes (the dense side, and LoGRA's dense remainder) are Megatron's Adam as
``optim/dense_memory.py`` declares it (``DENSE_ROWS["adam"]``, which the planner reads too): an
fp32 gradient buffer (``grad_reduce_in_fp32``), fp32 masters only when the parameters are
bf16/fp16, two fp32 moments and torch's step counter per parameter. Counts are per rank (this
rank's TP/PP shard).
"""

from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from logra_megatron.logra import update_memory
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch_memory import FP32, LEFT, RIGHT, SketchedWeight
from logra_megatron.optim.dense_memory import DENSE_ROWS

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
    (moments and step) and what the update rule declares (logra/update_memory.py), its masters the fp32
    copies of sketched weights when the weights are low precision and ``--logra-master fp32``."""
    sketchable = {id(module.weight): (name, module, side) for name, module, side in _sketchable(model, logra_config)}
    low_precision = next(model.parameters()).dtype != torch.float32
    master = FP32 if low_precision else 0
    # Megatron's Adam row reads ``bf16`` of a plan's settings: low-precision weights get fp32 masters.
    adam = DENSE_ROWS.get("adam")
    precision = SimpleNamespace(bf16=low_precision)
    every = [param.numel() for param in model.parameters()]
    remainder = [param.numel() for param in model.parameters() if id(param) not in sketchable]
    dense_gpu, _ = adam(precision, sum(every), every)
    remainder_gpu, _ = adam(precision, sum(remainder), remainder)
    sketched_numel = sketch_numel = projection_numel = probe_numel = 0
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
    # DP reduces the gradient buffer: the dense one, or the remainder's and the sketches with their probes
    dense = StateBytes(
        grad_bytes=dense_gpu["grad_bytes"], optimizer_state_bytes=dense_gpu["moment_bytes"],
        master_weight_bytes=dense_gpu["master_bytes"], projection_bytes=0,
        dp_comm_bytes_per_step=dense_gpu["grad_bytes"])
    sketch_grads = (sketch_numel + probe_numel) * FP32
    logra = StateBytes(
        grad_bytes=remainder_gpu["grad_bytes"] + sketch_grads,
        # the dense remainder's Adam, and the update rule's state as the rule declares it
        optimizer_state_bytes=remainder_gpu["moment_bytes"] + update_memory.state_bytes(rule, sketch_numel, lines),
        master_weight_bytes=remainder_gpu["master_bytes"] + sketched_numel * sketched_master,
        projection_bytes=projection_numel * FP32,
        dp_comm_bytes_per_step=remainder_gpu["grad_bytes"] + sketch_grads)
    return {"dense": dense, "logra": logra}
