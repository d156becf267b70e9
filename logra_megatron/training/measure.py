"""What a training step costs on this rank, measured: the training state held (live tensors by
component), the peak of allocations during one step, and the bytes that step passed to each
collective (by process-group kind).

Shared by the benchmarks (``tools/benchmark_optimizer.py``) and the smoke job's
``--report-json`` (the TP/PP scaling sweep, ``launch/scaling_sweep.sh``), so both report the
same figures in the same way.
"""

import time

# torch and megatron-core load inside the functions: the benchmarks' parent processes import this
# module while checking their flags, which should fail before torch has loaded.

COMPONENTS = ("weight_bytes", "master_bytes", "grad_bytes", "sketch_bytes", "moment_bytes",
              "projection_bytes", "controller_extra_bytes")
"""The parts of the training state :func:`measure_components` reports; their sum is the
training state."""


def measure_components(model, ddp, optimizer, controller_extra: int = 0) -> dict:
    """Bytes of the live tensors of each component of a
    :class:`~logra_megatron.training.optimizer.TrainingOptimizer` (Megatron's Adam or LoGRA),
    storages counted once across components.

    ``model`` is the bare model; ``optimizer`` has taken at least one step (Adam's moments are
    created by the first); ``controller_extra`` is what a KL controller held during the step.
    ``ddp`` is not read (its gradient buffers are counted through the optimizer); it stays in
    the signature the benchmarks call. ``moment_bytes`` holds the dense optimizer's moments and,
    under LoGRA, the tensors of the update rule's ``state()``: the component the planner fills
    with what the rule declares (logra/update_memory.py), so the two compare name for name."""
    from logra_megatron.platform.memory import tensor_bytes

    seen = set()
    state = optimizer.state_bytes()
    weights = tensor_bytes(model.parameters(), seen)
    sketches = 0
    if hasattr(optimizer, "sketch_buffer"):  # LoGRA: the sketch buffer and the norm probes' samples
        probes = optimizer.norm_estimator.flat if optimizer.norm_estimator is not None else None
        sketches = tensor_bytes([optimizer.sketch_buffer.flat, probes], seen)
    return {
        "weight_bytes": weights,
        "master_bytes": state["master_weight_bytes"],
        "grad_bytes": state["grad_bytes"] - sketches,
        "sketch_bytes": sketches,
        "moment_bytes": state["optimizer_state_bytes"],
        "projection_bytes": state["projection_bytes"],
        "controller_extra_bytes": controller_extra,
    }


def rank_coordinates() -> dict:
    """``{global rank: {"tp", "pp", "dp"}}`` for every rank of the world (one collective over the
    world: call it on every rank, outside any measured block)."""
    import torch.distributed as dist

    from logra_megatron import parallel

    mine = {"tp": parallel.tp_rank(), "pp": parallel.pp_rank(), "dp": parallel.dp_rank()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return dict(enumerate(everyone))


def measure_step(run_step, coordinates: dict):
    """Run ``run_step()`` once under an :class:`AllocationTracker` and a :class:`CommCounter`.

    Returns ``(what run_step returned, figures)``: ``peak_step_bytes`` (the peak of tensor
    allocations during the step beyond what was live before it), ``tracked_step_s`` (its wall
    time, slowed by the CPU profiler), ``comm_bytes_by_kind`` (bytes passed to collectives per
    group kind, see :func:`~logra_megatron.platform.comm_counter.group_kind`) and
    ``comm_by_op`` (calls and bytes per operation and kind)."""
    from logra_megatron.platform.comm_counter import CommCounter
    from logra_megatron.platform.memory import AllocationTracker

    start = time.perf_counter()
    with AllocationTracker() as tracked, CommCounter() as comm:
        result = run_step()
    summary = comm.summary(coordinates)
    return result, {
        "peak_step_bytes": tracked.peak_bytes,
        "tracked_step_s": time.perf_counter() - start,
        "comm_bytes_by_kind": summary["by_kind"],
        "comm_by_op": summary["by_op"],
    }


def dense_state_by_device(optimizer, counted=()) -> dict:
    """Bytes of the state the dense optimizers inside ``optimizer`` hold, each storage once, by
    device type (``{"cpu": ..., "cuda": ...}``): every tensor in their inner torch optimizer's
    ``state`` (Adam's moments and step; bitsandbytes' 8-bit moments, block scales and the
    quantization maps all its parameters share; ``HybridDeviceOptimizer``'s host masters) and,
    under CPU offload, the pinned host gradients (``cpu_copy_map_grad``). Counting each storage
    once is what tells the shared maps from per-parameter state. ``counted``: tensors counted
    elsewhere (the weights and the masters Megatron's optimizer names), left out: the offload's
    state names each main it updates on the GPU as ``master_param``."""
    import torch

    seen, by_device = set(), {}

    def add(tensor):
        if not torch.is_tensor(tensor):
            return
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device.type)
        if key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        by_device[tensor.device.type] = by_device.get(tensor.device.type, 0) + storage.nbytes()

    for tensor in counted:
        seen.add((tensor.untyped_storage().data_ptr(), tensor.device.type))
    for part in optimizer.dense:
        inner = part.optimizer
        for state in inner.state.values():
            for value in state.values():
                add(value)
        for grad in getattr(inner, "cpu_copy_map_grad", {}).values():
            add(grad)
    return by_device


def host_rss_bytes() -> dict:
    """The process's resident memory now and its peak (Linux: ``/proc/self/statm``, ``ru_maxrss``),
    in bytes: the host's figure beside the tensors (runtime, allocator caches and libraries in it)."""
    import os
    import resource

    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # The kernel updates the high-water mark lazily: it can trail the resident size read just now.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"host_rss_bytes": resident, "host_peak_rss_bytes": max(peak, resident)}
