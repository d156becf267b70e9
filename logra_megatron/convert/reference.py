"""The Hugging Face side of verification: load an HF folder offline, compute its logits and
greedy continuations the same way the Megatron side does (full forward per token, fp32)."""

import os

import torch

from logra_megatron.convert.hf_io import TOKENIZER_FILES

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "12 + 30 =",
    "Once upon a time, there was a",
)


def load_hf_model(directory: str, dtype: torch.dtype = torch.float32):
    """An HF causal LM from a local folder, never touching the hub, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True,
                                                 attn_implementation="eager")
    model.eval()
    return model


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def load_tokenizer(directory: str):
    """The folder's tokenizer (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def encode_prompts(directory: str, prompts, vocab: int, seed: int = 0, length: int = 12) -> list:
    """Token ids of ``prompts`` with the folder's tokenizer, or, for a folder without one
    (tiny test models), one seeded random prompt of ``length`` tokens per prompt."""
    if has_tokenizer(directory):
        tokenizer = load_tokenizer(directory)
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in prompts]


def hf_logits_fn(model):
    """The HF model as a ``logits_fn`` (``[batch, seq]`` tokens -> fp32 logits) for
    :func:`logra_megatron.convert.runtime.greedy_tokens` and ``sequence_logits``."""

    @torch.no_grad()
    def logits(tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, use_cache=False).logits.float()

    return logits
