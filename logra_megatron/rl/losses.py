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

**Dual clip** (Ye et al. 2020, verl's ``clip_ratio_c``): for a negative advantage the clipped
term grows without bound in the ratio, so one token whose probability rose a lot since sampling
can dominate the batch. With ``clip_ratio_c = c > 1`` the per-token loss of a token with
``A < 0`` is capped at ``-A * c``; 0 disables the cap.

**Aggregation** (verl's ``loss_agg_mode`` names): ``token-mean`` (the default, above) divides the
token sum by the response tokens; ``seq-mean-token-mean`` averages each sequence's tokens, then
the sequences; ``seq-mean-token-sum`` sums each sequence's tokens, then averages the sequences
(Dr. GRPO's length-unbiased form). The KL and entropy terms use the same aggregation. Under data
parallelism the divisor is the count (tokens or sequences) of the whole optimizer step's batch
over every replica: :func:`aggregation_count` gives this rank's share to sum.

The log-probs themselves come from vocab-parallel logits: see
:mod:`logra_megatron.ops.vocab_parallel`.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from logra_megatron.errors import UserError
from logra_megatron.schema import option

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The GRPO policy loss. Validated on construction."""

    clip_low: float = option(0.2, help="the probability ratio is clipped below at 1 - clip_low")
    clip_high: float = option(0.28, help="the ratio is clipped above at 1 + clip_high (DAPO's clip-higher)")
    kl_coef: float = option(0.0, help="weight of the KL-to-reference penalty; 0 keeps no reference model")
    kl_estimator: str = option("low_var_kl", choices=KL_ESTIMATORS,
                               help="per-token estimator of the KL to the reference (module docstring)")
    entropy_coef: float = option(0.0, help="weight of an entropy bonus (subtracted from the loss)")
    clip_ratio_c: float = option(3.0, help="dual clip: a token with a negative advantage contributes at most "
                                           "-A * clip_ratio_c to the loss (verl's default 3; 0 disables)")
    loss_agg_mode: str = option("token-mean", choices=LOSS_AGG_MODES,
                                help="how per-token losses become the step's loss (verl's names; "
                                     "the module docstring of rl/losses.py)")
    num_minibatches: int = option(1, help="optimizer steps per pass over a rollout batch: the batch is split "
                                          "into this many minibatches, each one KL-controlled optimizer step")
    ppo_epochs: int = option(1, help="passes over each rollout batch; the old log-probs are computed once per "
                                     "batch, so after the first step the ratio departs from 1 and clipping acts")
    tis_cap: float = option(0.0, help="truncated importance sampling (verl's TIS): weight each token's "
                                      "policy-gradient term by min(exp(logp_trainer_old - logp_engine), C) for "
                                      "a rollout engine whose log-probs differ from the trainer's (vllm); "
                                      "0 = off; no effect with an engine that returns no log-probs")

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise UserError(f"--clip-low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise UserError(f"--clip-high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c != 0.0 and not self.clip_ratio_c > 1.0:
            raise UserError(f"--clip-ratio-c must be > 1 (or 0 to disable the dual clip), got {self.clip_ratio_c}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise UserError(f"unknown --loss-agg-mode {self.loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
        for name in ("num_minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kl_coef < 0.0:
            raise UserError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if not (self.tis_cap >= 0.0 and math.isfinite(self.tis_cap)):
            raise UserError(f"--tis-cap must be a finite number >= 0 (0 = off), got {self.tis_cap}")
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


def aggregation_count(response_mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """What ``mode`` divides by, counted on ``response_mask`` alone: response tokens for
    ``token-mean``, sequences with at least one response token otherwise. Summed over the
    microbatches and data-parallel ranks of one optimizer step, it is the step's divisor."""
    mask = response_mask.bool()
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(dim=-1) > 0).sum()


def aggregate_loss(values: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean",
                   normalizer: Optional[float] = None) -> torch.Tensor:
    """Per-token ``values`` ``[batch, seq]`` -> one scalar by ``mode`` (module docstring),
    divided by ``normalizer`` (default: :func:`aggregation_count` of ``response_mask``, at
    least 1)."""
    if normalizer is None:
        normalizer = aggregation_count(response_mask, mode).clamp(min=1).to(values.dtype)
    if mode == "token-mean":
        return masked_token_sum(values, response_mask) / normalizer
    mask = response_mask.bool()
    per_sequence = torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=-1).clamp(min=1).to(values.dtype)
    elif mode != "seq-mean-token-sum":
        raise UserError(f"unknown --loss-agg-mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    return per_sequence.sum() / normalizer


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
    clip_ratio_c: float = 0.0,
    agg_mode: str = "token-mean",
    token_weights: Optional[torch.Tensor] = None,
):
    """Token-level PPO/GRPO clipped surrogate, with the dual clip when ``clip_ratio_c > 1``
    (module docstring).

    Args:
        logprobs: ``[batch, seq]`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``[batch, seq]`` the same under the policy that sampled them (constant).
        advantages: ``[batch]`` per sequence (broadcast over tokens) or ``[batch, seq]``.
        response_mask: ``[batch, seq]``, 1/True on response tokens, 0 on prompt and padding.
        normalizer: divide by this instead of the mask's count (:func:`aggregate_loss`).
        clip_ratio_c: the dual clip's cap for negative advantages (0: off).
        agg_mode: one of ``LOSS_AGG_MODES``.
        token_weights: ``[batch, seq]`` constant factors on each token's term after clipping
            (truncated importance sampling, :func:`tis_weights`); None: 1.

    Returns:
        ``(loss, metrics)``: the scalar loss, and detached 0-dim tensors ``clip_fraction``
        (share of response tokens where the clipped term is the smaller one, so the token gets
        no gradient), ``dual_clip_fraction`` (share where the dual clip's cap applied),
        ``ratio_mean``, ``ratio_max``, ``ratio_min`` and ``num_tokens``.
    """
    mask = response_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    advantages = _per_token(advantages.detach(), logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if clip_ratio_c:
        cap = -advantages * clip_ratio_c
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = aggregate_loss(per_token, mask, agg_mode, normalizer)

    with torch.no_grad():
        num_tokens = mask.sum()
        count = num_tokens.clamp(min=1).to(ratio.dtype)
        selected = ratio[mask]
        metrics = {
            "clip_fraction": masked_token_sum((clipped < unclipped).to(ratio.dtype), mask) / count,
            "dual_clip_fraction": masked_token_sum(dual_clipped.to(ratio.dtype), mask) / count,
            "ratio_mean": masked_token_sum(ratio, mask) / count,
            "ratio_max": selected.max() if selected.numel() else ratio.new_ones(()),
            "ratio_min": selected.min() if selected.numel() else ratio.new_ones(()),
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


def tis_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, response_mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Truncated importance sampling weights ``min(exp(old - engine), cap)`` per response token
    (1 elsewhere): the rollout engine sampled from its own distribution, which differs from the
    trainer's old policy by rounding and kernels; the policy gradient is an expectation under the
    trainer's, so each token is reweighted by the ratio, truncated at ``cap`` to bound variance."""
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_logprobs.detach() - engine_logprobs.detach(), torch.zeros_like(old_logprobs))
    return torch.exp(log_ratio).clamp(max=cap)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
    engine_logprobs: Optional[torch.Tensor] = None,
):
    """The full GRPO loss: clipped surrogate + ``kl_coef`` * KL - ``entropy_coef`` * entropy,
    each aggregated by ``config.loss_agg_mode`` with the same normalizer. Returns ``(loss, metrics)``; metrics are
    the surrogate's plus ``pg_loss``, and ``kl`` / ``entropy`` when those terms are on.

    With ``config.tis_cap > 0`` and the rollout engine's log-probs of the sampled tokens
    (``engine_logprobs``), the surrogate's tokens carry :func:`tis_weights` (metric
    ``tis_weight_mean``); the KL and entropy terms do not."""
    weights = None
    if config.tis_cap > 0.0 and engine_logprobs is not None:
        weights = tis_weights(old_logprobs, engine_logprobs, response_mask, config.tis_cap)
    loss, metrics = clipped_surrogate_loss(
        logprobs, old_logprobs, advantages, response_mask,
        clip_low=config.clip_low, clip_high=config.clip_high, normalizer=normalizer,
        clip_ratio_c=config.clip_ratio_c, agg_mode=config.loss_agg_mode, token_weights=weights,
    )
    metrics["pg_loss"] = loss.detach()
    if weights is not None:
        metrics["tis_weight_mean"] = masked_token_mean(weights, response_mask).detach()
    if config.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
        # Zero both log-probs off the response first: padding garbage (-inf, 1e30) would
        # otherwise overflow in k3's exp and turn its zero gradient into NaN.
        mask = response_mask.bool()
        kl_per_token = kl_estimate(torch.where(mask, logprobs, torch.zeros_like(logprobs)),
                                   torch.where(mask, ref_logprobs, torch.zeros_like(ref_logprobs)),
                                   config.kl_estimator)
        kl = aggregate_loss(kl_per_token, mask, config.loss_agg_mode, normalizer)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.detach()
    if config.entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        mean_entropy = aggregate_loss(entropy, response_mask, config.loss_agg_mode, normalizer)
        loss = loss - config.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    return loss, metrics
