"""Token sampling from next-token logits: temperature, top-k, top-p (nucleus), seeded.

Pure tensor functions, no process groups: :mod:`logra_megatron.rollout.megatron_engine` calls
:func:`sample_next` on one rank per model replica and broadcasts the result. All arithmetic is
done in float32 whatever the logits' dtype, so bf16 models sample from the same distribution
their logits describe.

Filters return logits with the removed entries set to ``-inf``; they compose in the order
temperature -> top-k -> top-p (the order used by Hugging Face and vLLM), so top-p sees the
distribution that top-k and temperature left.
"""

from typing import Optional

import torch


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (``k <= 0`` or ``k >= vocab``: keep all).

    Entries tied with the k-th largest value are kept too, so the result does not depend on how
    ``topk`` breaks ties.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose total probability
    reaches ``p``; the most probable token is always kept (``p >= 1``: keep all).

    A token survives when the probability mass of the tokens strictly more probable than it
    (in sorted order) is below ``p``.
    """
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                    top_p: float = 1.0) -> torch.Tensor:
    """float32 logits after temperature (> 0), top-k and top-p: the sampling distribution is
    ``softmax`` of the result."""
    logits = logits.float() / temperature
    logits = top_k_filter(logits, top_k)
    return top_p_filter(logits, top_p)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits`` ([batch, vocab]) -> int64 [batch].

    ``temperature == 0`` is greedy (argmax; the first index wins a tie) and ignores top-k/top-p
    and the generator. Otherwise one draw per row from the filtered distribution, using
    ``generator`` (same generator state + same logits -> same tokens).
    """
    if temperature == 0:
        return torch.argmax(logits.float(), dim=-1)
    probs = torch.softmax(filtered_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
