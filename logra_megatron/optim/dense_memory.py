"""What each dense optimizer holds on one rank, declared here beside the optimizers rather than in
the planner: the rows of ``tools/plan_memory.py --optimizer`` that are Megatron's dense optimizers
(and LoGRA's dense remainder, which is Megatron's Adam). The planner (``planning/state.py``) lays
out the parameters and adds these up, and ``logra/accounting.py`` counts a built model's dense
Adam with the ``adam`` entry; a new dense row is one entry of :data:`DENSE_ROWS` and
touches no file in ``planning/``.

Each entry is ``row(settings, grad_buffer_numel, mains) -> (gpu, host)``: ``grad_buffer_numel``
is the length of DDP's gradient buffer on the rank, ``mains`` the element counts of the parameter
shards the optimizer updates there (in its order; the rank's shard under the distributed
optimizer); ``settings`` gives ``bf16``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``,
``main_grads_dtype`` and ``optimizer_offload_fraction``. ``gpu`` has ``grad_bytes``,
``master_bytes``, ``moment_bytes``; ``host`` the :data:`HOST_COMPONENTS`. Entry ``info``:
``needs_distributed`` (runs only with Megatron's distributed optimizer), ``controller`` (may run
under the KL controller). Torch-free: a plan is arithmetic on flags.

Read from megatron-core 0.16.1 (file names under ``megatron/core/optimizer/``).
"""

from typing import Dict, Sequence, Tuple

from logra_megatron.ops.multiples import ceil_div
from logra_megatron.registry import Registry

FP32 = 4
ADAM_STEP_BYTES = 4
"""torch's AdamW keeps its step count as a 0-dim fp32 tensor per parameter (the CPU fallback;
Transformer Engine's FusedAdam keeps it in the param group: 0 bytes, a negligible overcount)."""
MOMENT_DTYPES = {"fp32": 4, "bf16": 2, "fp8": 1}
"""Bytes per element of the precision-aware optimizer's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``."""
HOST_COMPONENTS = ("host_master_bytes", "host_grad_bytes", "host_moment_bytes")
"""What one rank keeps in host memory (``adam-cpu-offload``: the offloaded shards' fp32 masters,
their pinned fp32 gradients, their Adam moments and step)."""
BLOCKWISE_8BIT_BLOCK = 256
"""Block-wise 8-bit Adam (bitsandbytes ``Adam8bit``, torchao ``AdamW8bit``): elements per
quantization block, each with one fp32 absmax scale per moment."""
BLOCKWISE_8BIT_MIN_NUMEL = 4096
"""bitsandbytes' ``min_8bit_size``: smaller tensors keep fp32 moments."""

Bytes = Tuple[Dict[str, int], Dict[str, int]]


def proposal_copies_bytes(main_numel: int) -> int:
    """What a step proposed under the KL controller holds beside a dense optimizer, from propose to
    commit: its ``main_numel`` fp32 mains before and after the step (``optim/controlled.py:
    ControlledOptimizer``, whose ``extra_bytes()`` measures the same copies live)."""
    return 2 * main_numel * FP32


DENSE_ROWS = Registry("dense optimizer row", "--optimizer")
"""The dense optimizers the planner plans, by row name."""


def _empty(grad_buffer_numel: int, grad_element: int = FP32) -> Bytes:
    return (dict(grad_bytes=grad_buffer_numel * grad_element, master_bytes=0, moment_bytes=0),
            dict.fromkeys(HOST_COMPONENTS, 0))


def _adam_on_gpu(settings, mains: Sequence[int], gpu: Dict[str, int]) -> None:
    """fp32 masters of bf16 weights and two fp32 moments plus torch's step, on the GPU."""
    gpu["master_bytes"] = sum(mains) * (FP32 if settings.bf16 else 0)
    gpu["moment_bytes"] = sum(mains) * 2 * FP32 + len(mains) * ADAM_STEP_BYTES


@DENSE_ROWS.register("adam", help="Megatron's Adam: fp32 gradient buffer, fp32 masters of bf16 weights, fp32 moments",
                     needs_distributed=False, controller=True)
def adam(settings, grad_buffer_numel: int, mains: Sequence[int]) -> Bytes:
    """DDP's fp32 gradient buffer (``grad_reduce_in_fp32``), fp32 masters of bf16 weights
    (``distrib_optimizer.py``: ``shard_model_param.clone().float()``; ``optimizer.py``'s
    ``Float16OptimizerWithFloat16Params`` without it), two fp32 moments and torch's step."""
    gpu, host = _empty(grad_buffer_numel)
    _adam_on_gpu(settings, mains, gpu)
    return gpu, host


@DENSE_ROWS.register("adam-precision-aware", help="Megatron's precision-aware Adam: bf16 gradients, 16-bit master "
                     "remainders, bf16 (or fp8) moments", needs_distributed=True, controller=False)
def adam_precision_aware(settings, grad_buffer_numel: int, mains: Sequence[int]) -> Bytes:
    """``optimizer_config.py``: ``use_precision_aware_optimizer`` (the distributed optimizer and
    TE's FusedAdam): the gradient buffer in ``main_grads_dtype`` bf16; with bf16 weights and
    ``store_param_remainders`` (default True) the master is the 16 bits the bf16 weight lacks
    (``distrib_optimizer.py``: ``master_param`` as ``torch.int16``), fp32 weights are their own
    masters; ``exp_avg`` / ``exp_avg_sq`` in their dtypes (fp8: one byte, TE's per-tensor scale
    not counted); FusedAdam keeps ``step`` in the param group."""
    gpu, host = _empty(grad_buffer_numel, 2)
    gpu["master_bytes"] = sum(mains) * 2 if settings.bf16 else 0
    gpu["moment_bytes"] = sum(mains) * (MOMENT_DTYPES[settings.exp_avg_dtype] + MOMENT_DTYPES[settings.exp_avg_sq_dtype])
    return gpu, host


def offloaded_shards(settings, mains: Sequence[int]) -> int:
    """How many of ``mains`` (in the optimizer's order) ``HybridDeviceOptimizer`` moves to the host
    (cpu_offloading/hybrid_optimizer.py ``_get_sub_optimizer_param_groups``: a parameter is
    offloaded while the elements offloaded so far are below ``fraction x`` all of them)."""
    threshold = sum(mains) * settings.optimizer_offload_fraction
    offloaded, count = 0, 0
    for elements in mains:
        if offloaded >= threshold:
            break
        offloaded += elements
        count += 1
    return count


@DENSE_ROWS.register("adam-cpu-offload", help="Megatron's CPU offload: the offloaded shards' masters, gradients "
                     "and moments in host memory", needs_distributed=True, controller=False)
def adam_cpu_offload(settings, grad_buffer_numel: int, mains: Sequence[int]) -> Bytes:
    """``optimizer_cpu_offload``, ``optimizer_offload_fraction``; ``cpu_offloading/
    hybrid_optimizer.py`` with ``param_update_in_fp32=True`` as ``optimizer/__init__.py`` builds
    it, and the precision-aware path that leaves the masters to it, as slime's recipe runs it: the
    gradient buffer on the GPU (fp32, or bf16 with ``main_grads_dtype`` bf16); each offloaded shard
    an fp32 host copy (``.cpu().pin_memory()`` then ``.float()``), a pinned fp32 host gradient
    (``cpu_copy_map_grad``), CPUAdam's two fp32 moments and step tensor; the rest fp32 masters
    (bf16 weights) and moments on the GPU."""
    gpu, host = _empty(grad_buffer_numel, 2 if settings.main_grads_dtype == "bf16" else FP32)
    count = offloaded_shards(settings, mains)
    on_host, on_gpu = mains[:count], mains[count:]
    _adam_on_gpu(settings, on_gpu, gpu)
    host["host_master_bytes"] = sum(on_host) * FP32
    host["host_grad_bytes"] = sum(on_host) * FP32
    host["host_moment_bytes"] = sum(on_host) * 2 * FP32 + len(on_host) * ADAM_STEP_BYTES
    return gpu, host


@DENSE_ROWS.register("adam-8bit", help="block-wise 8-bit Adam (bitsandbytes, torchao): one byte a moment element",
                     needs_distributed=False, controller=False)
def adam_8bit(settings, grad_buffer_numel: int, mains: Sequence[int]) -> Bytes:
    """As :func:`adam`, with block-wise 8-bit moments: one byte an element and an fp32 absmax per
    block of :data:`BLOCKWISE_8BIT_BLOCK` per moment; fp32 below :data:`BLOCKWISE_8BIT_MIN_NUMEL`."""
    gpu, host = adam(settings, grad_buffer_numel, mains)
    moments = 0
    for elements in mains:
        if elements < BLOCKWISE_8BIT_MIN_NUMEL:
            moments += 2 * elements * FP32
        else:
            moments += 2 * (elements + FP32 * ceil_div(elements, BLOCKWISE_8BIT_BLOCK))
    gpu["moment_bytes"] = moments + len(mains) * ADAM_STEP_BYTES
    return gpu, host
