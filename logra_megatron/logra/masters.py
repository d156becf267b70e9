"""How a low-rank update reaches the sketched weights (docs/ALGORITHM.md, "Master weights").

``W <- (1 - a wd) W - a dW(U)`` with ``a = lr x scale`` is applied one block of rows at a time:
``addmm_`` of the block's factors (:meth:`~logra_megatron.logra.sketch.LinearSketch.update_factors`)
into an fp32 target, so the step's extra memory is one block of at most the weight's sketch
size, never the dense ``m x n`` update or a cast copy of it.

fp32 weights are their own master and are updated in place. For bf16 weights ``--logra-master``
chooses where the update accumulates:

- ``fp32``: an fp32 master per sketched weight (4 bytes/param); the weight is its
  round-to-nearest copy. With ``--use-distributed-optimizer`` each data-parallel rank keeps the
  master rows of its share and broadcasts its updated rows, as Megatron's distributed optimizer
  shards its masters.
- ``bf16-sr``: no master; a block is taken to fp32, updated, and stochastically rounded back
  (:mod:`logra_megatron.ops.rounding`), unbiased, with random bits from (seed, weight name,
  step, element index in the full tensor): DP replicas and TP shards stay identical to each
  other and to TP=1, and a resumed run reproduces.
- ``none``: no master and round-to-nearest: an update below half a bf16 ulp of the weight is
  lost (lossy; kept to measure what the other two buy).
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.logra.config import MASTER_MODES
from logra_megatron.models.weights import global_indices
from logra_megatron.ops.budgets import SR_BLOCK_ELEMENTS
from logra_megatron.ops.rounding import stochastic_round_to_bf16
from logra_megatron.seeding import name_seed

SEED_STREAM = 7_919
"""Offset of the rounding seeds' counter, apart from the projections' and test matrices'."""


def row_ranges(rows: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous, nearly equal ``(start, stop)`` ranges covering ``rows``."""
    bounds = [rows * part // parts for part in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _decay_and_add(target: torch.Tensor, first: torch.Tensor, second: torch.Tensor, step: float,
                   weight_decay: float) -> None:
    """``target <- (1 - step wd) target - step (first @ second)``, in place."""
    if weight_decay:
        target.mul_(1.0 - step * weight_decay)
    target.addmm_(first, second, alpha=-step)


class MasterWeights:
    """Applies updates to the sketched weights of one model chunk in the chosen master mode.

    ``weights`` are :class:`~logra_megatron.logra.sketch_buffer.SketchedWeight` entries;
    ``shard_over_dp``: keep fp32 masters by rows over data parallel (ZeRO-1 mode).
    """

    def __init__(self, weights: list, mode: str, seed: int, shard_over_dp: bool = False):
        if mode not in MASTER_MODES:
            raise ValueError(f"unknown master mode {mode!r}")
        self.weights = weights
        dtypes = {entry.weight.dtype for entry in weights}
        self.low_precision = dtypes != {torch.float32}
        if mode == "bf16-sr" and dtypes != {torch.bfloat16}:
            raise ValueError("bf16-sr stochastic rounding needs bf16 weights")
        self.mode = mode if self.low_precision else "weights"  # fp32 weights are their own master
        self.seed = seed
        self.sharded = shard_over_dp and self.mode == "fp32" and parallel.dp_size() > 1
        self.rows: Dict[str, Tuple[int, int]] = {}
        self.masters: Dict[str, torch.Tensor] = {}
        self._indices: Dict[str, tuple] = {}
        for entry in weights:
            count = entry.weight.shape[0]
            self.rows[entry.name] = row_ranges(count, parallel.dp_size())[parallel.dp_rank()] \
                if self.sharded else (0, count)
        self.reload_from_weights()

    @torch.no_grad()
    def reload_from_weights(self) -> None:
        """fp32 masters := the weights (after the weights were loaded or set from outside)."""
        if self.mode != "fp32":
            return
        for entry in self.weights:
            start, stop = self.rows[entry.name]
            self.masters[entry.name] = entry.weight[start:stop].detach().float().clone()

    def block_rows(self, entry) -> int:
        """Rows per block: a block holds at most as many elements as the weight's sketch, so
        its fp32 temporary stays within a sketch's bytes; with stochastic rounding, whose int64
        temporaries take 8 bytes per element each, at most ``SR_BLOCK_ELEMENTS`` (a fixed budget:
        blocks of a sketch's eighth made a commit of thousands of tiny blocks, each a few dozen
        tensor ops, and took half of a CPU step on smollm2-135m)."""
        elements = SR_BLOCK_ELEMENTS if self.mode == "bf16-sr" else entry.numel
        return max(1, elements // entry.weight.shape[1])

    @torch.no_grad()
    def apply(self, update_full: torch.Tensor, step: float, weight_decay: float, step_count: int) -> None:
        """``W <- (1 - step wd) W - step dW(U)`` for every sketched weight; ``update_full`` is the
        flat low-rank update laid out like the sketch buffer; ``step_count`` seeds the rounding."""
        for entry in self.weights:
            update = entry.view(update_full)
            start, stop = self.rows[entry.name]
            block = self.block_rows(entry)
            for first in range(start, stop, block):
                self._apply_block(entry, update, slice(first, min(first + block, stop)), step,
                                  weight_decay, step_count)
            if self.sharded:
                self._broadcast_rows(entry)

    def _apply_block(self, entry, update, rows: slice, step, weight_decay, step_count) -> None:
        first, second = entry.sketch.update_factors(update, rows)
        weight = entry.weight
        if self.mode == "weights":
            _decay_and_add(weight[rows], first, second, step, weight_decay)
            return
        if self.mode == "fp32":
            offset = self.rows[entry.name][0]
            master = self.masters[entry.name][rows.start - offset:rows.stop - offset]
            _decay_and_add(master, first, second, step, weight_decay)
            weight[rows].copy_(master)
            return
        values = weight[rows].float()
        _decay_and_add(values, first, second, step, weight_decay)
        if self.mode == "none":
            weight[rows].copy_(values)
            return
        row_index, col_index, full_cols, full_rows = self._element_indices(entry)
        index = (row_index[rows] * full_cols).unsqueeze(1) + col_index
        seed = name_seed(self.seed, entry.name, SEED_STREAM + step_count)
        weight[rows].copy_(stochastic_round_to_bf16(values, index, seed, index_limit=full_rows * full_cols))

    def _element_indices(self, entry) -> tuple:
        """Full-tensor row and column indices of this shard's elements, and the full tensor's
        column and row counts (cached)."""
        if entry.name not in self._indices:
            weight = entry.weight
            cols = global_indices(weight, entry.name, 1)
            split = getattr(weight, "tensor_model_parallel", False)
            full_cols = weight.shape[1] * (parallel.tp_size() if split and weight.partition_dim == 1 else 1)
            full_rows = weight.shape[0] * (parallel.tp_size() if split and weight.partition_dim == 0 else 1)
            self._indices[entry.name] = (global_indices(weight, entry.name, 0), cols, full_cols, full_rows)
        return self._indices[entry.name]

    def _broadcast_rows(self, entry) -> None:
        """Every DP rank's updated rows to the other replicas (collective over DP)."""
        group = parallel.dp_group()
        for owner, (start, stop) in enumerate(row_ranges(entry.weight.shape[0], parallel.dp_size())):
            if stop > start:
                dist.broadcast(entry.weight.data[start:stop], src=dist.get_global_rank(group, owner), group=group)

    # --- accounting and checkpoints --------------------------------------------------------------

    def state_bytes(self) -> int:
        return sum(master.numel() * master.element_size() for master in self.masters.values())

    def full_master(self, entry) -> torch.Tensor:
        """This TP shard's whole fp32 master (gathered over DP rows when sharded): for checkpoints."""
        master = self.masters[entry.name]
        if not self.sharded:
            return master
        full = torch.empty(entry.weight.shape, dtype=torch.float32, device=master.device)
        group = parallel.dp_group()
        for owner, (start, stop) in enumerate(row_ranges(entry.weight.shape[0], parallel.dp_size())):
            if owner == parallel.dp_rank():
                full[start:stop] = master
            if stop > start:
                dist.broadcast(full[start:stop], src=dist.get_global_rank(group, owner), group=group)
        return full

    @torch.no_grad()
    def load_full_master(self, entry, full: torch.Tensor) -> None:
        start, stop = self.rows[entry.name]
        self.masters[entry.name] = full[start:stop].to(device=entry.weight.device, dtype=torch.float32,
                                                       copy=True).contiguous()
