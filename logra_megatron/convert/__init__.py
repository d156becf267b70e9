"""Hugging Face <-> Megatron checkpoint conversion.

``hf`` holds the pure mappings (HF config <-> :class:`ModelConfig`, HF tensors <-> full
Megatron tensors); ``hf_io`` reads and writes HF folders offline; ``runtime`` and ``reference``
run the Megatron and HF models for verification; ``launch`` re-runs a tool under torchrun.
The command-line tools in ``tools/`` are thin wrappers over these.
"""

from logra_megatron.convert.hf import (
    ARCHITECTURES,
    MegatronView,
    check_hf_names,
    detect_family,
    fuse_qkv,
    hf_config_from_model_config,
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_tensor,
    megatron_to_hf,
    model_config_from_hf,
    split_qkv,
    supported_architectures,
)

__all__ = [
    "ARCHITECTURES",
    "MegatronView",
    "check_hf_names",
    "detect_family",
    "fuse_qkv",
    "hf_config_from_model_config",
    "hf_names",
    "hf_to_megatron",
    "megatron_names",
    "megatron_tensor",
    "megatron_to_hf",
    "model_config_from_hf",
    "split_qkv",
    "supported_architectures",
]
