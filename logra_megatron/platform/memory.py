"""Measured memory: the bytes of live tensors, and the peak of tensor allocations during a block.

- :func:`tensor_bytes` counts the storage bytes of tensors, each storage once (views and
  aliases share a storage), so components that hold views of one flat buffer are not
  double-counted.
- :class:`AllocationTracker` measures, for a ``with`` block, the peak of the bytes allocated by
  tensors *beyond those live when the block began*, and the net change at its end. On CUDA it
  reads the caching allocator's counters (``torch.cuda.max_memory_allocated``); on the CPU it
  replays the allocator's allocation and free events recorded by the PyTorch profiler
  (``profile_memory=True``), which sees every tensor allocation, temporaries inside an op
  included. Process RSS is a different figure (the runtime, libraries, allocator caches) and is
  not used here.
"""

import time
from typing import Iterable, Optional

import torch


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]], seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries are skipped). Pass one
    ``seen`` set across calls to count a storage shared by two components once."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class AllocationTracker:
    """``with AllocationTracker() as track: ...`` then ``track.peak_bytes`` (the most bytes of
    tensor allocations live at once during the block, counted from what was live at its start)
    and ``track.net_bytes`` (allocated minus freed by its end). ``track.seconds`` is the
    block's wall time (the CPU profiler adds overhead)."""

    def __init__(self, device: Optional[torch.device] = None):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.net_bytes = 0
        self.seconds = 0.0
        self._profiler = None
        self._base = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile  # the profiler loads on first use

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.net_bytes = torch.cuda.memory_allocated(self.device) - self._base
            return False
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes, self.net_bytes = _replay_cpu_allocations(self._profiler)
        return False


def _replay_cpu_allocations(profiler) -> tuple:
    """``(peak, net)`` of the CPU allocation (+size) and free (-size) events the profiler
    recorded during the block, in time order (:func:`replay_allocations`).

    The profiler records allocator events only while a thread carries its thread-local state. A
    gloo worker thread carries it while it runs a collective (its ``gloo:`` record), not after:
    when the worker, not the caller, drops the last reference of the collective's ``Work`` (the
    caller's ``wait`` returned first, as happens when the machine is loaded and the worker is
    descheduled between finishing the work and releasing it), the buffers the Work owns are
    freed unseen. Two corrections, both sound:

    - a buffer the collective allocated on the caller's thread (inside its ``c10d::`` op: gloo's
      coalesced reduce-scatter clones its whole input and all-reduces the copy) is held by that
      op's Work alone; when its free is unseen it is freed when the worker that ran the work
      finished it (:func:`collective_frees`). A plain replay kept it to the end (the DDP
      gradient buffer's copy, +0.8 MB on a 1.0 MB step at DP2 under the distributed optimizer,
      in 2 runs out of 3 on a loaded machine);
    - an allocation at an address the replay still holds as live frees that earlier block first
      (the allocator cannot hand out a live address): a tensor of the caller's that a Work
      outlives (a TP all-reduce's input) is freed unseen the same way. A block freed unseen
      whose address is not reused and that no collective owns stays counted."""
    from torch._C._profiler import _EventType

    allocations, dispatches, runs = [], [], []
    stack = [(node, None) for node in profiler.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, owner = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            fields = node.typed[1]
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr, owner))
            continue
        name = node.name
        if name.startswith("c10d::") and owner is None:
            # the collective's op on the caller's thread; a gloo record inside it ran there
            # (send and recv), not on a worker
            inline = any(child.name.startswith("gloo:") for child in node.children)
            owner = len(dispatches)
            dispatches.append((node.start_time_ns, inline))
        elif name.startswith("gloo:") and node.parent is None:  # a worker running a Work
            runs.append((node.start_time_ns, node.end_time_ns))
        stack.extend((child, owner) for child in node.children)
    events = [(time, size, address) for time, size, address, _ in allocations]
    events.extend(collective_frees(allocations, dispatches, runs))
    return replay_allocations(events)


def collective_frees(allocations, dispatches, runs) -> list:
    """The unseen frees of collectives' own buffers, as ``(time, -size, address)`` events.

    ``allocations``: ``(time, size, address, owner)``, ``size`` negative for a free, ``owner``
    the index in ``dispatches`` of the collective op it was made in (None outside one);
    ``dispatches``: ``(start, inline)`` of each collective op on a caller's thread (``inline``:
    it ran there, no worker); ``runs``: ``(start, end)`` of each worker's run of a Work.

    A process group's worker threads take its Works in the order they were issued, so the
    ``k``-th collective op that hands one to a worker is run by the first run, in start order,
    that starts after it and after the runs of the ops before it. A buffer an op allocated
    whose free the replay never sees (no free at its address before the next allocation there,
    or none by the block's end) is freed at the end of that run: the worker releases the Work
    right after running it, and only a release on the worker goes unseen."""
    runs = sorted(runs)
    run_of, next_run = {}, 0
    for index in sorted(range(len(dispatches)), key=lambda i: dispatches[i][0]):
        start, inline = dispatches[index]
        if inline:
            continue
        while next_run < len(runs) and runs[next_run][0] < start:
            next_run += 1
        if next_run == len(runs):
            break
        run_of[index] = runs[next_run]
        next_run += 1
    open_blocks, unseen = {}, []  # address -> (time, size, owner) of the allocation not yet freed
    for time, size, address, owner in sorted(allocations, key=lambda item: item[0]):
        if size > 0:
            if address in open_blocks:
                unseen.append((open_blocks.pop(address), address, time))
            open_blocks[address] = (time, size, owner)
        else:
            open_blocks.pop(address, None)
    unseen.extend((block, address, None) for address, block in open_blocks.items())
    frees = []
    for (time, size, owner), address, reused in unseen:
        run = run_of.get(owner)
        if run is None or run[1] < time or (reused is not None and run[1] > reused):
            continue
        frees.append((run[1], -size, address))
    return frees


def replay_allocations(events) -> tuple:
    """``(peak, net)`` of ``(time, size, address)`` events (``size`` negative for a free)
    replayed in time order; an allocation at an address still live frees that block first."""
    live, current, peak = {}, 0, 0
    for _, size, address in sorted(events, key=lambda item: item[0]):
        if size > 0:
            current -= live.pop(address, 0)
            live[address] = size
        else:  # (a block live before the block began lowers the count below its start)
            live.pop(address, None)
        current += size
        peak = max(peak, current)
    return peak, current
