"""GRPO policy loss pieces: the clipped surrogate, KL-to-reference estimators, and token
log-probabilities / entropy / KL computed on vocab-parallel logits.

**Clipped surrogate, token-level.** With ``ratio = exp(logp - logp_old)`` per response token and
the sequence's advantage ``A`` broadcast over its tokens,

    loss = - sum_tokens mask * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
           / num_response_tokens

The sum runs over every response token of the batch and is divided by the number of response
tokens (DAPO's token-level aggregation), so long and short completions weigh each token
equally instead of each sequence equally. ``clip_low`` and ``clip_high`` are separate (DAPO's
"clip-higher" raises only ``clip_high`` to keep exploration alive). Under gradient accumulation
or data parallelism pass ``normalizer`` = the response-token count of the whole global batch
(divided by the number of gradient contributions that are averaged later, if any), so that
micro-batches of different lengths add up to the token-level mean of the global batch.
``logp_old`` is treated as a constant. Positions outside the response mask never reach ``exp``
(their log-ratio is replaced by 0), so garbage there cannot produce inf/NaN gradients.

**KL to the reference policy**, per token, with ``log_r = logp_ref - logp`` and samples drawn
from the policy (Schulman, "Approximating KL Divergence", 2020):
``k1 = -log_r`` (unbiased, high variance, can be negative); ``k2 = log_r^2 / 2`` (biased, low
variance); ``k3 = exp(log_r) - log_r - 1`` (unbiased, always >= 0); ``low_var_kl`` = ``k3`` with
``log_r`` clamped to [-20, 20] before the exp (no overflow when the policies have drifted far
apart) and the result clamped to [-10, 10] (as verl does), bounding the gradient any single
token can contribute. The reference log-probs are constants.

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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from logra_megatron.errors import UserError

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")

# Log-probabilities are clamped to at least this before they multiply a probability: exp() of
# anything below -746 is exactly 0 even in float64, so the clamp changes no value, but it turns
# ``0 * -inf`` (a -inf logit, e.g. a masked vocabulary entry) into ``0 * finite`` = 0.
_LOG_ZERO = -1000.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """The GRPO policy loss. Validated on construction."""

    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low``."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high`` (DAPO's clip-higher uses 0.28)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference penalty; 0 turns it off (no reference log-probs needed)."""
    kl_estimator: str = "low_var_kl"
    """Per-token KL estimator: k1, k2, k3 or low_var_kl (module docstring)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss); 0 turns it off."""

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise UserError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise UserError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise UserError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise UserError(
                f"unknown KL estimator {self.kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}"
            )


# --- token-level losses ------------------------------------------------------------------------

def masked_token_sum(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over response tokens (non-response positions contribute exactly 0)."""
    return torch.where(response_mask.bool(), values, torch.zeros_like(values)).sum()


def masked_token_mean(values: torch.Tensor, response_mask: torch.Tensor,
                      normalizer: Optional[float] = None) -> torch.Tensor:
    """Token-level mean: the masked sum divided by ``normalizer`` (default: the number of
    response tokens in ``response_mask``, at least 1)."""
    if normalizer is None:
        normalizer = response_mask.sum().clamp(min=1).to(values.dtype)
    return masked_token_sum(values, response_mask) / normalizer


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages ``[batch]`` over the token dimension of ``like``."""
    if advantages.dim() == like.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.to(like.dtype).expand_as(like)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    normalizer: Optional[float] = None,
):
    """Token-level PPO/GRPO clipped surrogate (module docstring).

    Args:
        logprobs: ``[batch, seq]`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``[batch, seq]`` the same under the policy that sampled them (constant).
        advantages: ``[batch]`` per sequence (broadcast over tokens) or ``[batch, seq]``.
        response_mask: ``[batch, seq]``, 1/True on response tokens, 0 on prompt and padding.
        normalizer: divide the token sum by this instead of the mask's token count.

    Returns:
        ``(loss, metrics)``: the scalar loss, and detached 0-dim tensors ``clip_fraction``
        (share of response tokens where the clipped term is the smaller one, so the token gets
        no gradient), ``ratio_mean``, ``ratio_max``, ``ratio_min`` and ``num_tokens``.
    """
    mask = response_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    advantages = _per_token(advantages.detach(), logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = masked_token_mean(-torch.minimum(unclipped, clipped), mask, normalizer)

    with torch.no_grad():
        num_tokens = mask.sum()
        count = num_tokens.clamp(min=1).to(ratio.dtype)
        selected = ratio[mask]
        metrics = {
            "clip_fraction": masked_token_sum((clipped < unclipped).to(ratio.dtype), mask) / count,
            "ratio_mean": masked_token_sum(ratio, mask) / count,
            "ratio_max": selected.max() if selected.numel() else torch.ones((), dtype=ratio.dtype),
            "ratio_min": selected.min() if selected.numel() else torch.ones((), dtype=ratio.dtype),
            "num_tokens": num_tokens,
        }
    return loss, metrics


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    Differentiable in ``logprobs``; ``ref_logprobs`` is a constant. Estimators: module docstring.
    """
    log_r = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1.0
    if estimator == "low_var_kl":
        log_r = torch.clamp(log_r, -20.0, 20.0)
        return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)
    raise UserError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
):
    """The full GRPO loss: clipped surrogate + ``kl_coef`` * KL - ``entropy_coef`` * entropy,
    each a token-level mean with the same normalizer. Returns ``(loss, metrics)``; metrics are
    the surrogate's plus ``pg_loss``, and ``kl`` / ``entropy`` when those terms are on."""
    loss, metrics = clipped_surrogate_loss(
        logprobs, old_logprobs, advantages, response_mask,
        clip_low=config.clip_low, clip_high=config.clip_high, normalizer=normalizer,
    )
    metrics["pg_loss"] = loss.detach()
    if config.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
        # Zero both log-probs off the response first: padding garbage (-inf, 1e30) would
        # otherwise overflow in k3's exp and turn its zero gradient into NaN.
        mask = response_mask.bool()
        kl_per_token = kl_estimate(torch.where(mask, logprobs, torch.zeros_like(logprobs)),
                                   torch.where(mask, ref_logprobs, torch.zeros_like(ref_logprobs)),
                                   config.kl_estimator)
        kl = masked_token_mean(kl_per_token, mask, normalizer)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.detach()
    if config.entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        mean_entropy = masked_token_mean(entropy, response_mask, normalizer)
        loss = loss - config.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    return loss, metrics


# --- vocab-parallel log-probs, entropy, KL -----------------------------------------------------

def _resolve_group(group):
    """The tensor-parallel group to reduce over, or None for a single process."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

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
    parts of ``sum_v p_v (log p_v - log q_v)``.
    """
    group = _resolve_group(group)
    dtype = torch.promote_types(_compute_dtype(logits_p), _compute_dtype(logits_q))
    scaled_p = logits_p.to(dtype) / temperature
    scaled_q = logits_q.to(dtype) / temperature
    maxima = _all_reduce(torch.stack([scaled_p.amax(-1), scaled_q.amax(-1)]), group, dist.ReduceOp.MAX)
    log_p = scaled_p - maxima[0].unsqueeze(-1)
    log_q = scaled_q - maxima[1].unsqueeze(-1)
    sum_exp = _all_reduce(torch.stack([log_p.exp().sum(-1), log_q.exp().sum(-1)]), group)
    # A q of exactly 0 where p > 0 gives a large finite KL (about 1000) instead of +inf.
    log_p = (log_p - sum_exp[0].log().unsqueeze(-1)).clamp_(min=_LOG_ZERO)
    log_q = (log_q - sum_exp[1].log().unsqueeze(-1)).clamp_(min=_LOG_ZERO)
    local_kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return _all_reduce(local_kl, group)
