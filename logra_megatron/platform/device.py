"""Device detection: CUDA when present, otherwise CPU with the megatron-core adapter."""

import functools
import os

import torch


def cuda_available() -> bool:
    """True when a usable CUDA device exists (``LOGRA_FORCE_CPU=1`` pretends there is none)."""
    if os.environ.get("LOGRA_FORCE_CPU") == "1":
        return False
    return torch.cuda.is_available()


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

    On CUDA the local device is selected from ``LOCAL_RANK``. On CPU the adapter is installed
    (it must happen before any model, optimizer or RNG tracker is built).
    """
    if cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return "cuda"
    from logra_megatron.platform.cpu_adapter import install_cpu_adapter  # CPU only: it patches megatron-core

    install_cpu_adapter()
    return "cpu"
