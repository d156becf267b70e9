"""Model family: Llama / Qwen2 / Mistral style decoders as Megatron ``GPTModel``s.

- ``config.py``     ModelConfig and the presets (plain data: no megatron-core import)
- ``build.py``      ModelConfig -> TransformerConfig + layer spec -> GPTModel
- ``sdpa_attention.py``  the layer spec's core attention on torch's scaled_dot_product_attention
- ``positions.py``  left-padding masks and per-row rotary positions
- ``weights.py``    full TP=1 tensors <-> this rank's TP/PP shards; layout-independent init
"""

import importlib

# Resolved on first use (PEP 562): the config schema imports ``models.config`` without loading
# megatron-core, so that a bad flag fails in a second or two.
_EXPORTS = {
    "PRESETS": "config", "ModelConfig": "config", "get_preset": "config",
    "build_gpt_model": "build", "causal_attention_mask": "build", "gpt_layer_spec": "build",
    "model_device": "build", "position_ids_for": "build", "transformer_config": "build", "transformer_engine_available": "build",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
