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
