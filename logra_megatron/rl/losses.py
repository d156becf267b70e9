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

The log-probs themselves come from vocab-parallel logits: see
:mod:`logra_megatron.ops.vocab_parallel`.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from logra_megatron.errors import UserError
from logra_megatron.schema import option

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")



@dataclass(frozen=True)
class PolicyLossConfig:
    """The GRPO policy loss. Validated on construction."""

    clip_low: float = option(0.2, help="the probability ratio is clipped below at 1 - clip_low")
    clip_high: float = option(0.28, help="the ratio is clipped above at 1 + clip_high (DAPO's clip-higher)")
    kl_coef: float = option(0.0, help="weight of the KL-to-reference penalty; 0 keeps no reference model")
    kl_estimator: str = option("low_var_kl", choices=KL_ESTIMATORS,
                               help="per-token estimator of the KL to the reference (module docstring)")
    entropy_coef: float = option(0.0, help="weight of an entropy bonus (subtracted from the loss)")

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise UserError(f"--clip-low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise UserError(f"--clip-high must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise UserError(f"--kl-coef must be >= 0, got {self.kl_coef}")
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
