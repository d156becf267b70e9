"""Sketch reduction overlapped with the backward, in buckets, as Megatron's DDP overlaps the
dense gradient reduction (``--overlap-grad-reduce``).

The flat sketch buffer (``logra/sketch_buffer.py``) is cut into contiguous buckets of whole
weights (:class:`~logra_megatron.logra.sketch_buffer.Bucket`). On the last microbatch of a step
(Megatron's schedules run every other microbatch inside ``config.no_sync_func``) each sketching
layer reports when its backward has added to its sketch; when every weight of a bucket has
reported, the bucket's data-parallel reduction starts asynchronously while the backward goes on
through earlier layers. The buffer is laid out in forward order, so the last bucket fills first,
exactly as Megatron's reversed buckets do. :meth:`OverlappedSketchReduction.finish` (called by
the optimizer's ``prepare_grads``) starts any bucket that never filled (a weight the step did not
reach) and waits for all of them.

The reduction is an all-reduce of the bucket, or under ZeRO-1 (``--use-distributed-optimizer``)
a reduce-scatter of it into this rank's part of the bucket: the buffer gives each DP rank
``1 / DP`` of every bucket, as Megatron's distributed optimizer shards each bucket of its
gradient buffer, so a bucket's reduce-scatter is complete on its own. The result is the blocking
reduction's at the same buckets, bit for bit: every element is reduced once by the same
collective over the same group, with the same bytes.

Megatron-LM's ``train()`` sets ``config.no_sync_func = [chunk.no_sync for chunk in model]`` when
``overlap_grad_reduce`` is on; :func:`install_no_sync` makes each DDP chunk's ``no_sync`` also
hold the sketch reports back, so that loop runs unchanged.
"""

import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist

class OverlappedSketchReduction:
    """The buffer's buckets (``buffer.buckets``), whose DP reductions start as soon as their
    sketches are final. ``sites``: how many backward sites add to each sketch per microbatch
    (``id(sketch) -> count``; 1 where absent): a tied output layer and the embedding lookup on one
    stage both add to the embedding's."""

    def __init__(self, buffer, group, sites: Dict[int, int]):
        self.buffer = buffer
        self.group = group
        self.buckets: List = buffer.buckets
        self._bucket_of: Dict[int, int] = {}
        self._sites = dict(sites)
        for index, bucket in enumerate(self.buckets):
            for entry in bucket.weights:
                self._bucket_of[id(entry.sketch)] = index
                entry.sketch.on_accumulated = self._report
        self._no_sync_depth = 0
        self.reset()

    def reset(self) -> None:
        """A new step: no reports, no reduction in flight."""
        self._reports: Dict[int, int] = {}
        self._pending = [len(bucket.weights) for bucket in self.buckets]
        self._handles = [None] * len(self.buckets)
        self._shard = None
        """ZeRO-1: this rank's slice, filled bucket by bucket by the reduce-scatters."""

    @contextlib.contextmanager
    def no_sync(self):
        """Microbatches run inside this context are not the step's last: their reports are held."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _report(self, sketch) -> None:
        if self._no_sync_depth:
            return
        key = id(sketch)
        index = self._bucket_of[key]
        if self._handles[index] is not None:
            raise RuntimeError(
                f"the sketch of {sketch.name} was added to after its bucket's reduction started: with "
                "overlap_grad_reduce, every microbatch but the last must run inside config.no_sync_func "
                "(Megatron-LM sets it to [chunk.no_sync for chunk in model])")
        self._reports[key] = self._reports.get(key, 0) + 1
        if self._reports[key] == self._sites.get(key, 1):
            self._pending[index] -= 1
            if self._pending[index] == 0:
                self._start(index)

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.buffer.sliced:
            if self._shard is None:  # new each step, as the blocking reduction's: the step's gradient
                self._shard = self.buffer.flat.new_empty(self.buffer.slice_numel)
            self._handles[index] = self.buffer.reduce_scatter_bucket(bucket, self._shard, async_op=True)
            return
        self._handles[index] = dist.all_reduce(self.buffer.flat[bucket.start:bucket.end], group=self.group,
                                               async_op=True)

    @property
    def started(self) -> int:
        """Buckets whose reduction is in flight or done (for tests and the benchmark)."""
        return sum(handle is not None for handle in self._handles)

    def finish(self) -> torch.Tensor:
        """Start what never started, wait for everything; the DP mean of the whole buffer, or
        under ZeRO-1 of this rank's slice."""
        for index, handle in enumerate(self._handles):
            if handle is None:
                self._start(index)
        for handle in self._handles:
            handle.wait()
        reduced = self._shard if self.buffer.sliced else self.buffer.flat
        self._shard = None
        return reduced.div_(dist.get_world_size(group=self.group))


def install_no_sync(model_chunks, reduction: OverlappedSketchReduction) -> None:
    """Make each DDP chunk's ``no_sync`` also hold the sketch reports (see the module's note)."""
    for chunk in model_chunks:
        dense_no_sync = chunk.no_sync

        @contextlib.contextmanager
        def no_sync(dense_no_sync=dense_no_sync):
            with dense_no_sync(), reduction.no_sync():
                yield

        chunk.no_sync = no_sync
