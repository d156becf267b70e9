"""Model family: Llama / Qwen2 / Mistral style decoders as Megatron ``GPTModel``s."""

from logra_megatron.models.build import (
    build_gpt_model,
    causal_attention_mask,
    gpt_layer_spec,
    position_ids_for,
    transformer_config,
    transformer_engine_available,
)
from logra_megatron.models.config import PRESETS, ModelConfig, get_preset

__all__ = [
    "PRESETS",
    "ModelConfig",
    "build_gpt_model",
    "causal_attention_mask",
    "get_preset",
    "gpt_layer_spec",
    "position_ids_for",
    "transformer_config",
    "transformer_engine_available",
]
