"""The flat sketch buffer: every sketched weight's gradient sketch as a view into one fp32 buffer.

It owns what is per weight and what is communicated:

- the bookkeeping of each sketched weight (:class:`SketchedWeight`: its module, its
  :class:`~logra_megatron.logra.sketch.LinearSketch` with the initial projection, its offset in
  the flat buffer);
- the data-parallel reduction of the sketches: a mean by all-reduce, or in ZeRO-1 mode a
  reduce-scatter so each DP rank keeps one slice (docs/ALGORITHM.md, "DP reduction and ZeRO-1");
  the buffer's buckets (:class:`Bucket`), the units of that reduction, which the backward starts
  one by one with ``--overlap-grad-reduce`` (``logra/sketch_overlap.py``);
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
from logra_megatron.logra.buckets import bucket_layout
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.layers import _SketchingMixin, sketched_modules
from logra_megatron.logra.projection import random_orthonormal
from logra_megatron.logra.sketch import RIGHT, LinearSketch
from logra_megatron.logra.sketch_overlap import OverlappedSketchReduction
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
        self.bucket = None
        """The :class:`Bucket` that holds its sketch (set by the buffer)."""

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


class Bucket:
    """A contiguous range ``[start, end)`` of the flat buffer holding whole weights, reduced by
    one collective. In ZeRO-1 mode it is padded to a multiple of the DP size and each DP rank owns
    ``shard`` elements of it, ``[start + dp_rank * shard, ... + shard)``, as Megatron's distributed
    optimizer shards each bucket of its gradient buffer: a bucket's reduce-scatter then leaves
    every rank its part as soon as that bucket is reduced, without waiting for the others.
    ``local``: where this rank's part of the bucket starts in its slice (the parts of all buckets,
    in bucket order)."""

    def __init__(self, start: int, end: int, weights: list, dp: int, local: int):
        self.start, self.end, self.weights = start, end, weights
        self.shard = (end - start) // dp
        self.local = local

    def owned(self, dp_rank: int):
        """``(first, last)``: the full-buffer range rank ``dp_rank`` owns of this bucket."""
        first = self.start + dp_rank * self.shard
        return first, first + self.shard


class SketchBuffer:
    """All sketches of this rank's model chunks in one flat fp32 buffer, attached to their
    sketching linears.

    The buffer is cut into :class:`Bucket` s of whole weights of at least ``bucket_numel``
    elements each (None: one bucket), in forward order. In ZeRO-1 mode (``logra_config.zero1``)
    each bucket is padded to a multiple of the DP size and each DP rank owns ``1 / DP`` of every
    bucket, ``slice_numel`` elements in all; otherwise a "slice" is the whole buffer. With one
    bucket that is one contiguous slice of the whole buffer.
    """

    def __init__(self, models, logra_config: LogRAConfig, bucket_numel: Optional[int] = None):
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.logra = logra_config
        self.zero1 = logra_config.zero1
        self.dp = parallel.dp_size()
        entries = []
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
                                tied))
        if not entries:
            raise ValueError("the model has no sketching linears: build it with logra_layer_spec()")
        numels = [math.prod(LinearSketch.sketch_shape(e[3], e[4], e[5], e[7])) for e in entries]
        # Without buckets (no overlap) the tied embedding's two sums keep today's order (over the
        # stages, then over DP) and need no bucket of its own.
        shared = [e[8] and e[0] == TIED_EMBEDDING for e in entries]
        offsets, planned, padded = bucket_layout(numels, shared, bucket_numel, self.dp, self.zero1)
        device = model_device(models[0])  # every piece of LoGRA's state lives with the model
        self.flat = torch.zeros(padded, dtype=torch.float32, device=device)
        self.weights: List[SketchedWeight] = []
        line_offset = 0
        for (name, local_name, module, side, out_f, in_f, projected, rank, tied), offset in zip(entries, offsets):
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
        self.buckets: List[Bucket] = []
        local = 0
        for indices, start, end in planned:
            self.buckets.append(Bucket(start, end, [self.weights[i] for i in indices], self.dp if self.zero1 else 1,
                                       local))
            local += self.buckets[-1].shard
            for index in indices:
                self.weights[index].bucket = self.buckets[-1]
        self.slice_numel = local
        self.line_numel = line_offset
        """Length of flat per-line state (never sliced over DP)."""
        self.overlap: Optional[OverlappedSketchReduction] = None
        """The bucketed reduction that overlaps the backward (:meth:`overlap_with_backward`)."""
        self._models = models

    def overlap_with_backward(self) -> bool:
        """Reduce bucket by bucket during the last microbatch's backward (``logra/sketch_overlap.py``):
        all-reduces, or reduce-scatters in ZeRO-1 mode; False (nothing changed) where nothing is
        reduced (one DP replica)."""
        if self.dp == 1:
            return False
        if self.sliced and any(entry.tied_across_stages and entry.bucket.weights != [entry] for entry in self.weights):
            raise ValueError("the overlapped ZeRO-1 reduction needs the tied embedding in a bucket of its own: "
                             "build the buffer with a bucket_numel")
        sites = {}
        for model in self._models:
            for module in model.modules():
                sketch = getattr(module, "logra_sketch", None)
                if sketch is not None:
                    sites[id(sketch)] = sites.get(id(sketch), 0) + 1
        self.overlap = OverlappedSketchReduction(self, parallel.dp_group(), sites)
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
            shard = self.flat.new_empty(self.slice_numel)
            for bucket in self.buckets:
                self.reduce_scatter_bucket(bucket, shard)
            return shard.div_(self.dp)
        dist.all_reduce(self.flat, group=parallel.dp_group())
        return self.flat.div_(self.dp)

    def reduce_scatter_bucket(self, bucket: Bucket, shard: torch.Tensor, async_op: bool = False):
        """Sum ``bucket`` over DP into this rank's part of it in ``shard`` (a slice-long tensor)."""
        return dist.reduce_scatter_tensor(shard[bucket.local:bucket.local + bucket.shard],
                                          self.flat[bucket.start:bucket.end], group=parallel.dp_group(),
                                          async_op=async_op)

    def reduce_tied(self, reduced: Optional[torch.Tensor] = None) -> None:
        """Sum a tied embedding's sketch (and range and norm samples) over Megatron's embedding
        group: the first stage saw the lookups, the last stage the logits. ``reduced``: the
        sketch was already reduce-scattered over DP into this slice (the overlapped ZeRO-1
        reduction): sum this rank's part of it there, which is the same part of the same bucket
        on both stages (the embedding has a bucket of its own, :func:`plan_buckets`)."""
        for entry in self.weights:
            if entry.tied_across_stages:
                sketch = entry.sketch.sketch
                if reduced is not None and self.sliced:
                    sketch = self.local_part(entry, reduced)
                for tensor in (sketch, entry.sketch.range_sample, entry.sketch.norm_sample):
                    if tensor is not None:
                        dist.all_reduce(tensor, group=parallel_state.get_embedding_group())

    def local_part(self, entry: SketchedWeight, local: torch.Tensor):
        """The elements of ``entry`` within this rank's slice ``local`` (a flat view), or None."""
        if not self.sliced:
            return local[entry.offset:entry.offset + entry.numel]
        bucket = entry.bucket
        start, stop = bucket.owned(parallel.dp_rank())
        first, last = max(entry.offset, start), min(entry.offset + entry.numel, stop)
        base = bucket.local - start
        return local[base + first:base + last] if last > first else None

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
        if len(self.buckets) == 1:  # rank-major is bucket-major
            return gathered
        # rank-major (every rank's slice in turn) to the buffer's layout (every bucket in turn)
        by_rank = gathered.view(self.dp, self.slice_numel)
        full = torch.empty_like(gathered)
        for bucket in self.buckets:
            full[bucket.start:bucket.end].view(self.dp, bucket.shard).copy_(
                by_rank[:, bucket.local:bucket.local + bucket.shard])
        return full

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-length flat tensor: ``full`` itself when not sliced, a view
        with one bucket, else a new tensor of its parts of every bucket."""
        if not self.sliced:
            return full
        parts = [full[slice(*bucket.owned(parallel.dp_rank()))] for bucket in self.buckets]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
