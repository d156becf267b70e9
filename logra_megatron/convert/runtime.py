"""The Megatron side of conversion and verification: build a model at a layout, run it, share
results between ranks.

Converters and the logit comparison use the same three steps (start the layout, build the
model in the right precision, read full-vocabulary logits from vocab-parallel output), and the
multi-rank tests use them too, so the tools stay thin.
"""

from typing import Optional

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.errors import UserError
from logra_megatron.models import ModelConfig, build_gpt_model, transformer_config
from logra_megatron.training.lm import forward_logits

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch dtype -> the name HF writes in config.json.
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_layout(model: ModelConfig, tensor_parallel: int, pipeline_parallel: int,
                 world_size: int, model_name: str = "model"):
    """The validated :class:`~logra_megatron.parallel.ParallelLayout` (a :class:`UserError` if
    the layout cannot split ``model``), checked before any process group starts."""
    layout = parallel.ParallelLayout(tensor_parallel, pipeline_parallel, world_size)
    layout.check_model(model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab,
                       model_name)
    return layout


def build_model(model: ModelConfig, dtype: torch.dtype = torch.float32):
    """This rank's part of ``model`` at the current layout, in ``dtype``, in eval mode."""
    config = transformer_config(model, parallel.tp_size(), parallel.pp_size(), dtype=dtype)
    megatron = build_gpt_model(model, config)
    megatron.eval()
    return megatron


@torch.no_grad()
def full_vocab_logits(megatron, tokens: torch.Tensor, vocab: int) -> Optional[torch.Tensor]:
    """Full-vocabulary fp32 logits ``[batch, seq, vocab]`` of ``tokens`` (``[batch, seq]``, the
    same on every rank) on the last pipeline stage, ``None`` on the others: the vocab-parallel
    slices of :func:`~logra_megatron.training.lm.forward_logits` gathered over TP, the
    vocabulary padding dropped."""
    local = forward_logits(megatron, tokens)
    if local is None:
        return None
    local = local.float().contiguous()
    if parallel.tp_size() > 1:
        pieces = [torch.empty_like(local) for _ in range(parallel.tp_size())]
        dist.all_gather(pieces, local, group=parallel.tp_group())
        local = torch.cat(pieces, dim=-1)
    return local[..., :vocab]


def from_rank0(value):
    """``value`` as global rank 0 holds it, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def right_pad(sequences: list, pad: int = 0) -> torch.Tensor:
    """``[batch, longest]`` token tensor of ``sequences``, padded on the right.

    Under a causal mask, padding after a sequence cannot change the logits of its real
    positions, so sequences of different lengths share one forward pass.
    """
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor([list(sequence) + [pad] * (longest - len(sequence)) for sequence in sequences])


def sequence_logits(logits_fn, sequences: list) -> list:
    """Per sequence, the ``[len, vocab]`` logits of its real positions, from one batched call
    of ``logits_fn`` (``None`` where ``logits_fn`` returns ``None``: not the last stage)."""
    logits = logits_fn(right_pad(sequences))
    if logits is None:
        return None
    return [logits[row, : len(sequence)] for row, sequence in enumerate(sequences)]


@torch.no_grad()
def greedy_tokens(logits_fn, prompts: list, steps: int, share=lambda tokens: tokens) -> list:
    """``steps`` greedy tokens after every prompt, re-running the full (right-padded, batched)
    sequences for each token: no KV cache, so it checks exactly what a plain forward computes.

    ``logits_fn`` maps ``[batch, seq]`` tokens to ``[batch, seq, vocab]`` logits or ``None``;
    ``share`` makes the chosen tokens known to every rank
    (:func:`~logra_megatron.parallel.broadcast_object_from_last_stage`).
    """
    sequences = [list(prompt) for prompt in prompts]
    for _ in range(steps):
        logits = sequence_logits(logits_fn, sequences)
        chosen = None if logits is None else [int(rows[-1].argmax()) for rows in logits]
        for sequence, token in zip(sequences, share(chosen)):
            sequence.append(token)
    return [sequence[len(prompt):] for sequence, prompt in zip(sequences, prompts)]


def megatron_logits_fn(megatron, vocab: int):
    """:func:`full_vocab_logits` of ``megatron`` as a ``logits_fn`` for the helpers above."""
    return lambda tokens: full_vocab_logits(megatron, tokens, vocab)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}") from None
