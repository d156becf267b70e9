"""The flat sketch buffer: every sketched weight's gradient sketch as a view into one fp32 buffer.

It owns what is per weight and what is communicated:

- the bookkeeping of each sketched weight (:class:`SketchedWeight`: its module, its
  :class:`~logra_megatron.logra.sketch.LinearSketch` with the initial projection, its offset in
  the flat buffer);
- the data-parallel reduction of the sketches: a mean by all-reduce, or in ZeRO-1 mode a
  reduce-scatter so each DP rank keeps one slice (docs/ALGORITHM.md, "DP reduction and ZeRO-1");
  and the layout of per-element optimizer state between this rank's slice and the full buffer,
  and of per-line state (one value per row of a right sketch, per column of a left one: the
  weight's rows or columns that the projection does not mix; docs/ALGORITHM.md, "RowAdam");
- the sketch part of the global gradient norm (docs/ALGORITHM.md, "Exactness across TP": sketch
  shards are never TP-replicated, so their squares are summed over the model-parallel group).
"""

import math
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.layers import _SketchingMixin, sketched_modules
from logra_megatron.logra.projection import random_orthonormal
from logra_megatron.logra.sketch import RIGHT, LinearSketch
from logra_megatron.logra.sketch_overlap import DEFAULT_BUCKET_NUMEL, OverlappedSketchReduction
from logra_megatron.logra.update_memory import ELEMENT, LINE  # noqa: F401 (layouts of a rule's state)
from logra_megatron.models.build import model_device
from logra_megatron.models.weights import global_name, is_swiglu_fc1, layer_offset
from logra_megatron.ops.norms import squared_norm
from logra_megatron.seeding import name_seed


TIED_EMBEDDING = "embedding.word_embeddings.weight"


class SketchedWeight:
    """Bookkeeping for one sketched weight: its module, sketch, and views into flat buffers."""

    def __init__(self, name: str, local_name: str, module, sketch: LinearSketch, offset: int,
                 tied_across_stages: bool = False, pipeline_copy: bool = False, line_offset: int = 0):
        self.name = name  # global, e.g. decoder.layers.3.mlp.linear_fc1.weight
        self.local_name = local_name
        self.module = module
        self.sketch = sketch
        self.offset = offset  # into the flat sketch buffer
        self.numel = sketch.sketch.numel()
        self.shape = tuple(sketch.sketch.shape)
        self.line_offset = line_offset  # into flat per-line state
        self.lines = self.shape[0] if sketch.side == RIGHT else self.shape[1]
        """The sketch's lines the projection does not mix: the rows of a right sketch (``m x r``,
        the weight's output rows), the columns of a left one (``r x n``, its input columns)."""
        self.tied_across_stages = tied_across_stages
        """A tied embedding held by the first and the last pipeline stage: its sketches are
        summed over Megatron's embedding group."""
        self.pipeline_copy = pipeline_copy
        """The last stage's copy of a tied embedding: counted once, on the first stage, in
        norms and checkpoints."""
        self.vocab_rows = getattr(module, "logra_vocab_size", None)
        """Real vocabulary rows of an embedding or output weight (None for other weights)."""

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.module.weight

    @property
    def is_swiglu_fc1(self) -> bool:
        return is_swiglu_fc1(self.name)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This weight's part of a full-length flat buffer (the sketch buffer, or optimizer state
        laid out like it), shaped like its sketch."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)

    def line_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This weight's part of flat per-line state (``lines`` long). It is split over TP like
        the sketch's lines (its rows, or its columns), along its only axis."""
        return flat[self.line_offset : self.line_offset + self.lines]


class SketchBuffer:
    """All sketches of this rank's model chunks in one flat fp32 buffer, attached to their
    sketching linears.

    In ZeRO-1 mode (``logra_config.zero1``) the buffer is padded to a multiple of the DP size and
    each DP rank owns ``slice_numel`` elements of it; otherwise a "slice" is the whole buffer.
    """

    def __init__(self, models, logra_config: LogRAConfig):
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.logra = logra_config
        self.zero1 = logra_config.zero1
        self.dp = parallel.dp_size()
        entries = []
        total = 0
        for model in models:  # the model chunks of this rank (several with a virtual pipeline)
            offset_layers = layer_offset(model)
            tied = bool(getattr(model, "share_embeddings_and_output_weights", False)) and parallel.pp_size() > 1
            for local_name, module in sketched_modules(model):
                name = global_name(local_name, offset_layers) + ".weight"
                if local_name == "output_layer" and model.share_embeddings_and_output_weights:
                    name = TIED_EMBEDDING  # the pipeline copy: the embedding's projection and seeds
                out_features, in_features = module.weight.shape
                side = module.sketch_side
                projected = in_features if side == RIGHT else out_features
                rank = logra_config.rank_for(projected, name)
                entries.append((name, local_name, module, side, out_features, in_features, projected, rank,
                                total, tied))
                total += math.prod(LinearSketch.sketch_shape(side, out_features, in_features, rank))
        if not entries:
            raise ValueError("the model has no sketching linears: build it with logra_layer_spec()")
        padded = -(-total // self.dp) * self.dp if self.zero1 else total
        device = model_device(models[0])  # every piece of LoGRA's state lives with the model
        self.flat = torch.zeros(padded, dtype=torch.float32, device=device)
        self.weights: List[SketchedWeight] = []
        line_offset = 0
        for name, local_name, module, side, out_f, in_f, projected, rank, offset, tied in entries:
            if logra_config.identity_projection:
                if rank != projected:
                    raise ValueError(f"identity projection needs full rank ({projected}) for {name}")
                projection = torch.eye(projected, device=device)
            else:
                projection = random_orthonormal(projected, rank, name_seed(logra_config.seed, name), device=device)
            shape = LinearSketch.sketch_shape(side, out_f, in_f, rank)
            view = self.flat[offset : offset + math.prod(shape)].view(shape)
            sketch = LinearSketch(name, side, out_f, in_f, projection, view)
            module.logra_sketch = sketch
            self.weights.append(SketchedWeight(name, local_name, module, sketch, offset,
                                               tied_across_stages=tied and name == TIED_EMBEDDING,
                                               pipeline_copy=tied and local_name == "output_layer",
                                               line_offset=line_offset))
            line_offset += self.weights[-1].lines
        for model in models:
            for module in model.modules():  # a tied output layer on the embedding's stage
                if isinstance(module, _SketchingMixin) and module.weight is None:
                    module.logra_sketch = model.embedding.word_embeddings.logra_sketch
        self.slice_numel = padded // self.dp if self.zero1 else padded
        self.line_numel = line_offset
        """Length of flat per-line state (never sliced over DP)."""
        self.overlap: Optional[OverlappedSketchReduction] = None
        """The bucketed reduction that overlaps the backward (:meth:`overlap_with_backward`)."""
        self._models = models

    def overlap_with_backward(self, bucket_numel: Optional[int] = None) -> bool:
        """Reduce in buckets during the last microbatch's backward (``logra/sketch_overlap.py``);
        False (nothing changed) where it cannot help: one DP replica, or ZeRO-1 slices."""
        if self.dp == 1 or self.zero1:
            return False
        sites = {}
        for model in self._models:
            for module in model.modules():
                sketch = getattr(module, "logra_sketch", None)
                if sketch is not None:
                    sites[id(sketch)] = sites.get(id(sketch), 0) + 1
        self.overlap = OverlappedSketchReduction(self, parallel.dp_group(), sites,
                                                 bucket_numel or DEFAULT_BUCKET_NUMEL)
        return True

    @property
    def numel(self) -> int:
        """Length of the full (padded) flat buffer."""
        return self.flat.numel()

    @property
    def sliced(self) -> bool:
        """True when this rank holds only a slice of per-element state (ZeRO-1 over DP > 1)."""
        return self.zero1 and self.dp > 1

    def zero_(self) -> None:
        self.flat.zero_()
        if self.overlap is not None:
            self.overlap.reset()

    # --- data-parallel reduction -------------------------------------------------------------

    def reduce(self) -> torch.Tensor:
        """Mean of the sketches over data-parallel replicas; returns the gradient this rank
        updates from (the whole flat buffer, or its ZeRO-1 slice)."""
        if self.dp == 1:
            return self.flat if not self.zero1 else self.flat.clone()
        if self.overlap is not None:
            return self.overlap.finish()
        if self.zero1:
            shard = self.flat.new_empty(self.flat.numel() // self.dp)
            dist.reduce_scatter_tensor(shard, self.flat, group=parallel.dp_group())
            return shard.div_(self.dp)
        dist.all_reduce(self.flat, group=parallel.dp_group())
        return self.flat.div_(self.dp)

    def reduce_tied(self) -> None:
        """Sum a tied embedding's sketch (and range and norm samples) over Megatron's embedding
        group: the first stage saw the lookups, the last stage the logits."""
        for entry in self.weights:
            if entry.tied_across_stages:
                for tensor in (entry.sketch.sketch, entry.sketch.range_sample, entry.sketch.norm_sample):
                    if tensor is not None:
                        dist.all_reduce(tensor, group=parallel_state.get_embedding_group())

    def local_part(self, entry: SketchedWeight, local: torch.Tensor):
        """The elements of ``entry`` within this rank's slice ``local`` (a flat view), or None."""
        start = parallel.dp_rank() * self.slice_numel if self.sliced else 0
        first = max(entry.offset, start)
        last = min(entry.offset + entry.numel, start + local.numel())
        return local[first - start:last - start] if last > first else None

    def squared_norm(self, grads: torch.Tensor) -> float:
        """Squared norm of the whole model's reduced sketch gradient, from this rank's
        ``grads`` (what :meth:`reduce` returned): summed over the model-parallel group, and
        over DP slices in ZeRO-1 mode; a tied embedding's pipeline copy is counted once."""
        squared = squared_norm(grads)
        for entry in self.weights:
            part = self.local_part(entry, grads) if entry.pipeline_copy else None
            if part is not None:
                squared -= squared_norm(part)
        sketch_sq = squared.reshape(1)
        dist.all_reduce(sketch_sq, group=parallel_state.get_model_parallel_group())
        if self.sliced:
            dist.all_reduce(sketch_sq, group=parallel.dp_group())
        return float(sketch_sq)

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """A full-length flat tensor from this rank's slice (all-gathered over DP in ZeRO-1
        mode; otherwise ``local`` itself, not a copy)."""
        if not self.sliced:
            return local
        gathered = self.flat.new_empty(self.flat.numel())
        dist.all_gather_into_tensor(gathered, local, group=parallel.dp_group())
        return gathered

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-length flat tensor (a view; ``full`` itself when not
        sliced)."""
        if not self.sliced:
            return full
        start = parallel.dp_rank() * self.slice_numel
        return full[start : start + self.slice_numel]

    # --- inspection ------------------------------------------------------------------------------

    def sketches(self) -> dict:
        """This rank's current sketches by global weight name (views, not copies)."""
        return {entry.name: entry.sketch.sketch for entry in self.weights}

    def projections(self) -> dict:
        return {entry.name: entry.sketch.projection for entry in self.weights}

    def grad_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def projection_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.projections().values())
