"""Tiny random HF models of every supported family, built locally with transformers (no hub).

A plainly named module (not ``conftest``) so test modules can import ``TINY`` whatever order
pytest loads the tree's several conftest files in."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name -> (family, tie_word_embeddings, extra config). Between them: every family, tied and
# untied embeddings, GQA (4 heads, 2 kv heads), Qwen2's QKV bias, a head_dim that is not
# hidden / heads, and a vocabulary (1000) that Megatron pads (to 1024).
TINY = {
    "llama_tied": ("llama", True, {}),
    "llama_untied_hd32": ("llama", False, {"head_dim": 32}),
    "qwen2_tied": ("qwen2", True, {}),
    "mistral_untied": ("mistral", False, {}),
}


def build_tiny(family: str, tie: bool, extra: dict, seed: int = 0):
    """A 2-layer random HF model whose every tensor (norms and biases too) is non-trivial, so
    a mapping mistake anywhere changes the logits."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[family]
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                          max_position_embeddings=256, tie_word_embeddings=tie, **extra)
    torch.manual_seed(seed)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)
    return model.eval()
