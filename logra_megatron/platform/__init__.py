"""Platform layer: which device we run on, and the CPU adapter for megatron-core.

Call :func:`setup_platform` once per process before any Megatron model or optimizer is built.
On a CUDA machine it only selects the device; on a machine without CUDA it installs the adapter
in :mod:`logra_megatron.platform.cpu_adapter` (and nothing else in the project patches Megatron).
"""

from logra_megatron.platform.device import (
    cuda_available,
    default_backend,
    default_device,
    setup_platform,
)

__all__ = ["cuda_available", "default_backend", "default_device", "setup_platform"]
