"""Clipped surrogate, KL estimators and single-process vocab-parallel functions against hand
computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from logra_megatron.errors import UserError
from logra_megatron.ops.vocab_parallel import (
    vocab_parallel_kl,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)
from logra_megatron.rl.losses import (
    PolicyLossConfig,
    clipped_surrogate_loss,
    kl_estimate,
    masked_token_mean,
    policy_loss,
)

# --- clipped surrogate -------------------------------------------------------------------------

# Two sequences of four positions. Ratios chosen on either side of the clip range, for both
# advantage signs; the last position of sequence 0 is padding holding garbage.
RATIOS = [[1.5, 0.5, 1.1, 9.0], [1.5, 0.5, 1.25, 0.9]]
ADVANTAGES = [2.0, -1.0]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]


def surrogate_inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")], [-0.3, -1.2, -2.2, -0.7]], dtype=torch.float64)
    new = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).detach()
    new[0, 3] = 50.0  # padding: exp(50 - -inf) would overflow if it were not masked
    new.requires_grad_(True)
    return new, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


def hand_surrogate(clip_low, clip_high):
    """Loss, d loss / d logp and clip count by explicit per-token rules."""
    num_tokens = sum(map(sum, MASK))
    loss, grads, clipped = 0.0, [[0.0] * 4 for _ in range(2)], 0
    for i in range(2):
        advantage = ADVANTAGES[i]
        for j in range(4):
            if not MASK[i][j]:
                continue
            ratio = RATIOS[i][j]
            bounded = min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss -= min(ratio * advantage, bounded * advantage) / num_tokens
            clip_active = (advantage > 0 and ratio > 1 + clip_high) or (advantage < 0 and ratio < 1 - clip_low)
            clipped += clip_active
            # d(-ratio * A)/d logp = -ratio * A when the unclipped term is the minimum, else 0.
            grads[i][j] = 0.0 if clip_active else -ratio * advantage / num_tokens
    return loss, torch.tensor(grads, dtype=torch.float64), clipped / num_tokens


@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.2), (0.2, 0.28), (0.6, 0.05)])
def test_clipped_surrogate_value_gradient_and_metrics(clip_low, clip_high):
    new, old, advantages, mask = surrogate_inputs()
    loss, metrics = clipped_surrogate_loss(new, old, advantages, mask, clip_low, clip_high)
    loss.backward()
    expected_loss, expected_grad, expected_clip_fraction = hand_surrogate(clip_low, clip_high)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    torch.testing.assert_close(new.grad, expected_grad, atol=1e-12, rtol=0)
    assert metrics["clip_fraction"].item() == pytest.approx(expected_clip_fraction)
    masked_ratios = [r for row, m in zip(RATIOS, MASK) for r, keep in zip(row, m) if keep]
    assert metrics["ratio_mean"].item() == pytest.approx(sum(masked_ratios) / len(masked_ratios))
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["num_tokens"].item() == 7
    assert not any(value.requires_grad for value in metrics.values())


def test_clip_high_separately_from_clip_low():
    # ratio 1.25 with A < 0 is never clipped above; ratio 1.5 with A > 0 is clipped at 1.2 but
    # not at 1.6: only clip_high moves that.
    assert hand_surrogate(0.2, 0.2)[2] != hand_surrogate(0.2, 0.6)[2]
    new, old, advantages, mask = surrogate_inputs()
    _, low = clipped_surrogate_loss(new, old, advantages, mask, 0.2, 0.2)
    _, high = clipped_surrogate_loss(new, old, advantages, mask, 0.2, 0.6)
    assert low["clip_fraction"].item() == pytest.approx(2 / 7)  # (1.5, A>0) and (0.5, A<0)
    assert high["clip_fraction"].item() == pytest.approx(1 / 7)  # only (0.5, A<0)


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_policy_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]], requires_grad=True)
    advantages = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    # ratio 1 everywhere: loss = -(2 * 1.5 + 3 * -0.5) / 5, grad = -A / 5 on response tokens.
    assert loss.item() == pytest.approx(-(3.0 - 1.5) / 5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.3, -0.3, 0.0], [0.1, 0.1, 0.1]]))
    assert metrics["clip_fraction"].item() == 0.0


def test_token_level_aggregation_and_normalizer():
    # One long and one short sequence: every token weighs the same, not every sequence.
    logprobs = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    advantages = torch.tensor([1.0, -1.0])
    loss, _ = clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, mask)
    assert loss.item() == pytest.approx(-(4 * 1.0 - 1.0) / 5)
    # A global token count of 20 (e.g. four such micro-batches) divides the same sum by 20.
    scaled, _ = clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, mask, normalizer=20)
    assert scaled.item() == pytest.approx(-(4 * 1.0 - 1.0) / 20)


def test_per_token_advantages_are_accepted():
    new, old, advantages, mask = surrogate_inputs()
    per_token = advantages.unsqueeze(-1).expand(2, 4)
    a, _ = clipped_surrogate_loss(new, old, advantages, mask)
    b, _ = clipped_surrogate_loss(new, old, per_token, mask)
    assert a.item() == b.item()


def test_empty_mask_gives_zero_loss_not_nan():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    loss, metrics = clipped_surrogate_loss(logprobs, logprobs.detach(), torch.ones(1), torch.zeros(1, 3))
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_tokens"].item() == 0
    assert torch.equal(logprobs.grad, torch.zeros(1, 3))


# --- KL estimators -----------------------------------------------------------------------------

LOGP = [-1.0, -0.2, -3.0, -0.7]
REF = [-1.5, -0.2, -0.5, -2.0]


@pytest.mark.parametrize("estimator,formula", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1),
    ("low_var_kl", lambda lp, ref: min(max(math.exp(ref - lp) - (ref - lp) - 1, -10), 10)),
])
def test_kl_estimators_match_formulas(estimator, formula):
    logp = torch.tensor(LOGP, dtype=torch.float64)
    ref = torch.tensor(REF, dtype=torch.float64)
    expected = torch.tensor([formula(a, b) for a, b in zip(LOGP, REF)], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref, estimator), expected, atol=1e-12, rtol=0)


def test_k3_gradient_and_sign():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64)
    k3 = kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and k3[1].item() == 0.0  # equal log-probs: zero KL
    k3.sum().backward()
    torch.testing.assert_close(logp.grad, 1 - torch.exp(ref - logp.detach()))
    assert kl_estimate(logp, ref, "k1")[0].item() == pytest.approx(0.5)


def test_low_var_kl_is_clamped_where_k3_explodes():
    logp = torch.tensor([-60.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -60.0], dtype=torch.float64)
    k3 = kl_estimate(logp, ref, "k3")
    assert k3[0].item() > 1e20  # exp(60)
    low_var = kl_estimate(logp, ref, "low_var_kl")
    assert low_var[0].item() == 10.0
    assert k3[1].item() == pytest.approx(59.0)  # exp(-60) + 60 - 1
    assert low_var[1].item() == 10.0
    low_var.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(2, dtype=torch.float64))  # clamped: no gradient
    small = kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.5]), "low_var_kl")
    assert small.item() == pytest.approx(kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.5]), "k3").item())


def test_unknown_kl_estimator():
    with pytest.raises(UserError, match="k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(UserError, match="low_var_kl"):
        PolicyLossConfig(kl_estimator="nope")


# --- combined policy loss ----------------------------------------------------------------------

def test_policy_loss_adds_kl_and_entropy_terms():
    new, old, advantages, mask = surrogate_inputs()
    ref = old.clone()
    ref[0, 3] = 0.0
    entropy = torch.rand(2, 4, dtype=torch.float64)
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, metrics = policy_loss(new, old, advantages, mask, config, ref_logprobs=ref, entropy=entropy)
    surrogate, _ = clipped_surrogate_loss(new, old, advantages, mask, 0.2, 0.28)
    kl = masked_token_mean(kl_estimate(new, ref, "k3"), mask)
    expected = surrogate + 0.1 * kl - 0.01 * masked_token_mean(entropy, mask)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(surrogate.item())
    assert metrics["kl"].item() == pytest.approx(kl.item())
    assert set(metrics) >= {"clip_fraction", "ratio_mean", "pg_loss", "kl", "entropy"}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_policy_loss_gradient_is_finite_with_garbage_padding(estimator):
    new, old, advantages, mask = surrogate_inputs()  # new[0, 3] = 50, old[0, 3] = -inf
    ref = old.clone()
    ref[0, 3] = float("inf")
    config = PolicyLossConfig(kl_coef=0.5, kl_estimator=estimator)
    loss, _ = policy_loss(new, old, advantages, mask, config, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert new.grad[0, 3].item() == 0.0


def test_policy_loss_without_penalties_is_the_surrogate():
    new, old, advantages, mask = surrogate_inputs()
    loss, metrics = policy_loss(new, old, advantages, mask, PolicyLossConfig(clip_high=0.2))
    assert loss.item() == clipped_surrogate_loss(new, old, advantages, mask)[0].item()
    assert "kl" not in metrics and "entropy" not in metrics
    with pytest.raises(ValueError, match="reference"):
        policy_loss(new, old, advantages, mask, PolicyLossConfig(kl_coef=0.1))


@pytest.mark.parametrize("kwargs", [{"clip_low": 1.0}, {"clip_low": -0.1}, {"clip_high": -1},
                                    {"kl_coef": -0.5}])
def test_policy_loss_config_validation(kwargs):
    with pytest.raises(UserError):
        PolicyLossConfig(**kwargs)


# --- vocab-parallel functions on one process ---------------------------------------------------

def full_reference(logits, target, temperature=1.0):
    log_probs = F.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_single_rank_equals_log_softmax_and_entropy(dtype, tolerance, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 3, 11, generator=generator) * 4).to(dtype).requires_grad_(True)
    target = torch.randint(0, 11, (4, 3), generator=generator)
    weights = torch.randn(2, 4, 3, generator=generator).to(dtype)

    logprob, entropy = vocab_parallel_logprobs_and_entropy(logits, target, temperature)
    ref_logprob, ref_entropy = full_reference(logits, target, temperature)
    torch.testing.assert_close(logprob, ref_logprob, atol=tolerance, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=tolerance, rtol=0)

    ours = torch.autograd.grad((logprob * weights[0] + entropy * weights[1]).sum(), logits)[0]
    theirs = torch.autograd.grad((ref_logprob * weights[0] + ref_entropy * weights[1]).sum(), logits)[0]
    torch.testing.assert_close(ours, theirs, atol=tolerance * 10, rtol=0)
    assert ours.dtype == dtype


def test_gradcheck_in_double():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 7, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 7, (3, 2), generator=generator)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_logprobs_and_entropy(x, target, 0.8), (logits,))


def test_logprobs_only_and_input_untouched():
    logits = torch.randn(5, 9, dtype=torch.float32)
    saved = logits.clone()
    target = torch.arange(5)
    torch.testing.assert_close(vocab_parallel_logprobs(logits, target), full_reference(logits, target)[0])
    assert torch.equal(logits, saved)  # unlike Megatron's cross entropy, no in-place change


def test_target_shape_is_checked():
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))


def test_single_rank_kl():
    generator = torch.Generator().manual_seed(2)
    logits_p = torch.randn(6, 10, generator=generator, dtype=torch.float64)
    logits_q = logits_p + torch.randn(6, 10, generator=generator, dtype=torch.float64)
    expected = F.kl_div(F.log_softmax(logits_q, -1), F.log_softmax(logits_p, -1),
                        log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(vocab_parallel_kl(logits_p, logits_q), expected, atol=1e-13, rtol=0)
    assert vocab_parallel_kl(logits_p, logits_p).abs().max().item() < 1e-14
