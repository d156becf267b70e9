"""Log-probs, entropy and KL on vocab-parallel logits, and masking of the vocabulary padding.

**Vocab-parallel log-probs, entropy and KL.** Megatron's output layer leaves each
tensor-parallel rank with a slice ``[..., V/tp]`` of the logits (rank ``k`` holds vocabulary
ids ``k*V/tp .. (k+1)*V/tp - 1``). Gathering the vocabulary would cost ``V`` floats per token
per rank, so the softmax statistics are reduced instead: one all-reduce (MAX) of the per-token
maximum, then one all-reduce (SUM) of three per-token numbers: ``sum exp(z - max)``,
``sum exp(z - max) * (z - max)`` and the target's logit (contributed by the rank that owns
it). From these, ``logp(target) = z_t - max - logZ`` and
``H = logZ - sum p (z - max)`` with ``logZ = log sum exp(z - max)``.

The backward is analytic and needs no communication: ``d logp_t / dz_j = [j = t] - p_j`` and
``dH / dz_j = -p_j (log p_j + H)`` only involve the local slice and per-token scalars, provided
the incoming gradients are the same on every tensor-parallel rank, which holds because every
TP rank computes the same loss from the same replicated log-probs (Megatron's own convention).
Only the input logits are saved for backward (the probabilities are recomputed), so the
autograd graph holds no extra ``[..., V/tp]`` tensor. Computation is in float32, or float64 when
the logits are float64. Leading dimensions are free: ``[s, b, V/tp]`` as the output layer
produces it, or ``[b, s, V/tp]`` as ``GPTModel.forward`` returns it without labels; ``target``
has the leading shape. With a single rank (or no process group) the functions reduce to
``log_softmax`` / entropy of the full logits.
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from logra_megatron import parallel
from logra_megatron.ops.budgets import KL_CHUNK_ELEMENTS, kl_chunk_rows

# Log-probabilities are clamped to at least this before they multiply a probability: exp() of
# anything below -746 is exactly 0 even in float64, so the clamp changes no value, but it turns
# ``0 * -inf`` (a -inf logit, e.g. a masked vocabulary entry) into ``0 * finite`` = 0.
_LOG_ZERO = -1000.0


# --- vocab-parallel log-probs, entropy, KL -----------------------------------------------------

def _resolve_group(group):
    """The tensor-parallel group to reduce over, or None for a single process."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    return None


def _rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, group, op=None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _shifted_logits(logits: torch.Tensor, temperature: float, group):
    """``z - max z`` over the full vocabulary (float32/64, a new tensor) and the max."""
    scaled = logits.to(_compute_dtype(logits))
    scaled = scaled / temperature if temperature != 1.0 else scaled.clone()
    global_max = _all_reduce(scaled.amax(dim=-1), group, dist.ReduceOp.MAX)
    scaled -= global_max.unsqueeze(-1)
    return scaled, global_max


def _local_target(target: torch.Tensor, vocab_start: int, local_vocab: int):
    """Index of ``target`` in this rank's slice (0 where another rank owns it) and ownership."""
    owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
    local_index = torch.where(owned, target - vocab_start, torch.zeros_like(target))
    return local_index.long(), owned


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Per-token log-prob of ``target`` and entropy from vocab-parallel logits (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, temperature, group):
        local_vocab = logits.shape[-1]
        shifted, global_max = _shifted_logits(logits, temperature, group)
        local_index, owned = _local_target(target, _rank_in(group) * local_vocab, local_vocab)

        target_shifted = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
        target_shifted = torch.where(owned, target_shifted, torch.zeros_like(target_shifted))
        shifted.clamp_(min=_LOG_ZERO)  # after the target gather: only 0-probability entries move
        exp_shifted = shifted.exp()
        sums = torch.stack([
            exp_shifted.sum(dim=-1),
            shifted.mul_(exp_shifted).sum(dim=-1),  # in place: two [..., V/tp] temporaries at most
            target_shifted,
        ])
        del exp_shifted, shifted
        sum_exp, sum_exp_times_shifted, target_shifted = _all_reduce(sums, group)

        log_normalizer = sum_exp.log()
        logprob = target_shifted - log_normalizer
        entropy = log_normalizer - sum_exp_times_shifted / sum_exp

        ctx.save_for_backward(logits, local_index, owned, global_max, log_normalizer, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local_index, owned, global_max, log_normalizer, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None
        temperature = ctx.temperature
        log_p = logits.to(_compute_dtype(logits))
        log_p = log_p / temperature if temperature != 1.0 else log_p.clone()
        log_p -= (global_max + log_normalizer).unsqueeze(-1)
        log_p.clamp_(min=_LOG_ZERO)
        probs = log_p.exp()
        # grad = -p * (g_logprob + g_entropy * (log p + H)), plus g_logprob at the target.
        if grad_entropy is not None:
            grad = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_logprob is not None:
                grad.add_(grad_logprob.unsqueeze(-1))
        else:
            grad = log_p.copy_(grad_logprob.unsqueeze(-1).expand_as(log_p))
        grad.mul_(probs).neg_()
        del probs
        if grad_logprob is not None:
            at_target = torch.where(owned, grad_logprob, torch.zeros_like(grad_logprob))
            grad.scatter_add_(-1, local_index.unsqueeze(-1), at_target.unsqueeze(-1).to(grad.dtype))
        if temperature != 1.0:
            grad /= temperature
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, group=None,
):
    """Per-token ``(log p(target), entropy)`` of ``softmax(logits / temperature)`` where
    ``logits`` is this rank's vocabulary slice ``[..., V/tp]`` and ``target`` ``[...]`` holds
    global token ids. Differentiable in ``logits``; no vocabulary gather.

    ``group`` defaults to Megatron's tensor-parallel group when it is initialized, else to a
    single process. Every rank of the group must hold an equal slice (Megatron pads the
    vocabulary so it does).
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits "
                         f"{tuple(logits.shape)} without the vocabulary dimension")
    return _VocabParallelLogProbEntropy.apply(logits, target, float(temperature), _resolve_group(group))


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor,
                            temperature: float = 1.0, group=None) -> torch.Tensor:
    """Per-token ``log p(target)`` from vocab-parallel logits (see
    :func:`vocab_parallel_logprobs_and_entropy`; the entropy's backward costs nothing when it
    is not used)."""
    return vocab_parallel_logprobs_and_entropy(logits, target, temperature, group)[0]


@torch.no_grad()
def vocab_parallel_kl(logits_p: torch.Tensor, logits_q: torch.Tensor,
                      temperature: float = 1.0, group=None) -> torch.Tensor:
    """Per-token full-vocabulary ``KL(p || q)`` of two vocab-parallel logit slices of the same
    layout (e.g. the policy before and after a proposed update). Forward only.

    Three all-reduces of per-token numbers: the two maxima, the two normalizers, the local
    parts of ``sum_v p_v (log p_v - log q_v)``. Works in place on two float32/64 copies of the
    inputs: three tensors of the logits' size at most (the KL controller's reductions call it on
    token chunks, :func:`masked_kl_sum`).
    """
    group = _resolve_group(group)
    dtype = torch.promote_types(_compute_dtype(logits_p), _compute_dtype(logits_q))
    log_p = logits_p.to(dtype, copy=True)
    log_q = logits_q.to(dtype, copy=True)
    if temperature != 1.0:
        log_p /= temperature
        log_q /= temperature
    maxima = _all_reduce(torch.stack([log_p.amax(-1), log_q.amax(-1)]), group, dist.ReduceOp.MAX)
    log_p -= maxima[0].unsqueeze(-1)
    log_q -= maxima[1].unsqueeze(-1)
    sum_exp = _all_reduce(torch.stack([log_p.exp().sum(-1), log_q.exp().sum(-1)]), group)
    # A q of exactly 0 where p > 0 gives a large finite KL (about 1000) instead of +inf.
    log_p.sub_(sum_exp[0].log().unsqueeze(-1)).clamp_(min=_LOG_ZERO)
    log_q.sub_(sum_exp[1].log().unsqueeze(-1)).clamp_(min=_LOG_ZERO)
    log_ratio = log_q.sub_(log_p).neg_()  # log p - log q (negation is exact)
    local_kl = (log_p.exp_() * log_ratio).sum(-1)
    return _all_reduce(local_kl, group)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """Set the logits of Megatron's vocabulary padding (ids >= ``vocab_size``; how many depends
    on the TP size) to -inf on this rank's slice, so distributions do not depend on the layout."""
    if vocab_size is None:
        return logits
    local = logits.shape[-1]
    start = parallel.tp_rank() * local
    if start + local <= vocab_size:
        return logits
    padded = torch.arange(start, start + local, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, float("-inf"))


# --- means over the KL controller's probe tokens (sums over the vocabulary reduced over TP) ----

def _token_chunks(logits: torch.Tensor, chunk_elements: int):
    """Slices of the flattened token positions of ``logits`` (``[..., V/tp]``), each holding at
    most ``chunk_elements`` logits (at least one position): the same slices on every TP rank."""
    tokens = logits.numel() // max(1, logits.shape[-1])
    rows = kl_chunk_rows(logits.shape[-1], chunk_elements)
    return [slice(start, min(start + rows, tokens)) for start in range(0, tokens, rows)]


def masked_kl_sum(old_logits, new_logits, mask, chunk_elements: int = KL_CHUNK_ELEMENTS) -> float:
    """Sum over the masked tokens of KL(softmax(old) || softmax(new)), both vocab-parallel
    slices (divide by ``mask.sum()`` for the mean). The tokens are taken ``chunk_elements``
    logits at a time (ops/budgets.py), so the transient is three chunk-sized fp32 copies, not
    seven of the whole microbatch's logits; per token the KL is the unchunked one, the sum is
    accumulated in fp64 on the logits' device (one host sync)."""
    vocab = old_logits.shape[-1]
    old_flat, new_flat = old_logits.reshape(-1, vocab), new_logits.reshape(-1, vocab)
    mask_flat = mask.reshape(-1).to(old_logits.device)
    group = parallel.tp_group()
    total = torch.zeros((), dtype=torch.float64, device=old_logits.device)
    for rows in _token_chunks(old_logits, chunk_elements):
        per_token = vocab_parallel_kl(old_flat[rows], new_flat[rows], group=group)
        total += (per_token.double() * mask_flat[rows].double()).sum()
    return float(total)


@torch.no_grad()
def masked_half_variance_sum(logits, new_logits, epsilon: float, mask,
                             chunk_elements: int = KL_CHUNK_ELEMENTS) -> float:
    """Sum over the masked tokens of ``0.5 * Var_p(delta)`` with ``p = softmax(logits)`` and
    ``delta = (new_logits - logits) / epsilon`` (the linear KL forecast); all vocab-parallel
    slices (sums over the vocabulary all-reduced over TP). In fp64, ``chunk_elements`` logits at
    a time: three chunk-sized fp64 tensors, never a copy of the whole microbatch's logits."""
    vocab = logits.shape[-1]
    old_flat, new_flat = logits.reshape(-1, vocab), new_logits.reshape(-1, vocab)
    mask_flat = mask.reshape(-1).to(logits.device)
    group = parallel.tp_group()
    reduce = parallel.tp_size() > 1
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for rows in _token_chunks(logits, chunk_elements):
        weights = old_flat[rows].to(torch.float64, copy=True)
        delta = new_flat[rows].to(torch.float64, copy=True)
        delta.sub_(weights).div_(epsilon)
        maximum = weights.amax(-1, keepdim=True)
        if reduce:
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        weights.sub_(maximum).exp_()
        first = (weights * delta).sum(-1)
        second = (weights * delta.square_()).sum(-1)
        sums = torch.stack([weights.sum(-1), first, second])
        if reduce:
            dist.all_reduce(sums, group=group)
        mean = sums[1] / sums[0]
        variance = (sums[2] / sums[0] - mean.square()).clamp(min=0)
        total += (0.5 * variance * mask_flat[rows].double()).sum()
    return float(total)
