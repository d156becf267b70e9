"""Device detection: CUDA when present, otherwise CPU with the megatron-core adapter.

One process computes on one device: its local CUDA device (``LOCAL_RANK``), or the CPU. A job
that starts more processes on a node than it has GPUs cannot run there under NCCL (two ranks on
one GPU); it ends with one error line, unless ``LOGRA_CPU_WHEN_GPUS_SHORT=1`` asks for the CPU
instead (the test suite sets it, so its multi-rank checks run on gloo on a 1-GPU machine).
"""

import functools
import os

import torch

from logra_megatron.errors import UserError

CPU_WHEN_GPUS_SHORT = "LOGRA_CPU_WHEN_GPUS_SHORT"


def local_ranks() -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _gpus_short() -> bool:
    return local_ranks() > torch.cuda.device_count()


def cuda_available() -> bool:
    """True when this process computes on CUDA: a GPU exists, ``LOGRA_FORCE_CPU=1`` does not
    pretend there is none, and (with ``LOGRA_CPU_WHEN_GPUS_SHORT=1``) the node has a GPU for
    every local rank."""
    if os.environ.get("LOGRA_FORCE_CPU") == "1" or not torch.cuda.is_available():
        return False
    if os.environ.get(CPU_WHEN_GPUS_SHORT) == "1" and _gpus_short():
        return False
    return True


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device, or the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """torch.distributed backend: nccl on CUDA, gloo on CPU."""
    return "nccl" if cuda_available() else "gloo"


@functools.lru_cache(maxsize=None)
def setup_platform() -> str:
    """Prepare this process for megatron-core; idempotent. Returns ``"cuda"`` or ``"cpu"``.

    On CUDA the local device is selected from ``LOCAL_RANK`` (a :class:`UserError` when the node
    has fewer GPUs than local ranks). On CPU the adapter is installed (it must happen before any
    model, optimizer or RNG tracker is built).
    """
    if cuda_available():
        if _gpus_short():
            count = torch.cuda.device_count()
            raise UserError(
                f"{local_ranks()} processes on this node but {count} GPU(s): start at most {count} per node "
                f"(torchrun --nproc-per-node {count}), or set LOGRA_FORCE_CPU=1 to run on the CPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return "cuda"
    from logra_megatron.platform.cpu_adapter import install_cpu_adapter  # CPU only: it patches megatron-core

    install_cpu_adapter()
    return "cpu"
