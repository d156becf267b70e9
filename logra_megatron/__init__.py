"""logra_megatron: memory-efficient RL post-training of LLMs on Megatron-Core.

Layers of the package: ``platform`` (device and the CPU adapter), ``parallel`` (process groups
and layout), ``models`` (the decoder family), ``logra`` (gradient sketches, sketch-space
optimizer, predicted-KL control), ``rl`` (rollouts, rewards, GRPO trainer).
"""

__version__ = "0.1.0"

import os as _os
import warnings as _warnings

# megatron-core warns at import time about every optional CUDA library it lacks, and asks for
# CUDA_DEVICE_MAX_CONNECTIONS=1 (its recommended setting) on every async all-reduce.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "When using async grad allreduce"):
    _warnings.filterwarnings("ignore", message=_message)
_os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def __getattr__(name):
    """``logra_megatron.get_logra_optimizer``: LoGRA's optimizer factory, shaped like Megatron's
    ``get_megatron_optimizer`` (resolved on first use: importing the package loads no torch)."""
    if name == "get_logra_optimizer":
        from logra_megatron.logra.optimizer import get_logra_optimizer

        return get_logra_optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
