"""Truncated importance sampling (--tis-cap) in the policy loss: the weights, and what they do
to the loss and its gradient (logra_megatron/rl/losses.py)."""

import math

import pytest
import torch

from logra_megatron.errors import UserError
from logra_megatron.rl.losses import PolicyLossConfig, policy_loss, tis_weights


def batch():
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=generator) * 2
    engine = old + torch.randn(3, 5, generator=generator) * 0.5
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    return old, engine, mask, advantages


def test_weights_are_the_truncated_ratio_on_response_tokens():
    old, engine, mask, _ = batch()
    weights = tis_weights(old, engine, mask, cap=1.2)
    expected = torch.where(mask, torch.exp(old - engine).clamp(max=1.2), torch.ones_like(old))
    assert torch.allclose(weights, expected)
    assert float(weights.max()) == pytest.approx(1.2)  # some tokens hit the cap
    assert float(weights[mask].min()) < 1.0  # and some are down-weighted


def test_loss_gradient_is_reweighted_per_token():
    old, engine, mask, advantages = batch()
    logprobs = old.clone().requires_grad_(True)  # on-policy: ratio 1, no clipping
    plain = PolicyLossConfig(clip_ratio_c=0.0)
    weighted = PolicyLossConfig(clip_ratio_c=0.0, tis_cap=2.0)
    loss, _ = policy_loss(logprobs, old, advantages, mask, plain, engine_logprobs=engine)
    (grad_plain,) = torch.autograd.grad(loss, logprobs)
    loss_tis, metrics = policy_loss(logprobs, old, advantages, mask, weighted, engine_logprobs=engine)
    (grad_tis,) = torch.autograd.grad(loss_tis, logprobs)
    weights = tis_weights(old, engine, mask, 2.0)
    assert torch.allclose(grad_tis, grad_plain * weights)
    assert not torch.allclose(grad_tis, grad_plain)
    assert float(metrics["tis_weight_mean"]) == pytest.approx(float(weights[mask].mean()))


def test_off_or_without_engine_logprobs_changes_nothing():
    old, engine, mask, advantages = batch()
    logprobs = old + 0.1
    base, _ = policy_loss(logprobs, old, advantages, mask, PolicyLossConfig())
    off, metrics = policy_loss(logprobs, old, advantages, mask, PolicyLossConfig(), engine_logprobs=engine)
    none, _ = policy_loss(logprobs, old, advantages, mask, PolicyLossConfig(tis_cap=2.0))
    assert float(off) == float(base) == float(none)
    assert "tis_weight_mean" not in metrics


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_bad_tis_cap_is_a_user_error(value):
    with pytest.raises(UserError, match="--tis-cap"):
        PolicyLossConfig(tis_cap=value)


# --- the engine-vs-trainer mismatch (logged every step; --kl-subtract-mismatch spends it) ------

def test_mismatch_kl_estimates_the_kl_from_the_engine_to_the_trainer():
    """Tokens sampled from the engine's distribution: the mean of ``r - 1 - log r`` on them is
    KL(engine || trainer), here checked against the exact sum over a 5-token vocabulary."""
    from logra_megatron import parallel
    from logra_megatron.rl.trainer import engine_mismatch

    parallel.initialize(1, 1, seed=0)
    engine = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    trainer = torch.tensor([0.35, 0.3, 0.2, 0.1, 0.05], dtype=torch.float64)
    exact = float((engine * (engine / trainer).log()).sum())
    tokens = torch.multinomial(engine, 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, tokens.numel(), dtype=torch.bool)
    found = engine_mismatch(engine.log()[tokens][None], trainer.log()[tokens][None], mask)
    assert exact > 1e-3
    assert found["logp_mismatch_kl"] == pytest.approx(exact, rel=0.05)
    assert found["logp_mismatch_max"] == pytest.approx(float((engine.log() - trainer.log()).abs().max()))
    # Identical log-probs: no mismatch; masked positions never count.
    same = engine_mismatch(engine.log()[tokens][None], engine.log()[tokens][None], mask)
    assert same["logp_mismatch_kl"] == 0.0 and same["logp_mismatch_mean"] == 0.0
    masked = engine_mismatch(engine.log()[tokens][None], trainer.log()[tokens][None], torch.zeros_like(mask))
    assert masked["logp_mismatch_kl"] == 0.0
    assert engine_mismatch(None, trainer.log()[tokens][None], mask) == {}
