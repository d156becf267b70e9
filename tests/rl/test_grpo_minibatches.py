"""GRPO as the literature runs it: the dual clip, verl's loss aggregations, minibatch and
dynamic-sampling helpers, each against a hand computation on a fixed batch."""

import math

import pytest
import torch

from logra_megatron.errors import UserError
from logra_megatron.rl.losses import PolicyLossConfig, aggregate_loss, aggregation_count, clipped_surrogate_loss
from logra_megatron.rl.minibatches import combine_steps, kept_rows, split_minibatches, tied_groups

# Two sequences: one of 3 response tokens (the last column padding), one of 1.
LOG_RATIOS = [[2.0, -1.0, 0.1, 0.0], [0.5, 0.0, 0.0, 0.0]]
ADVANTAGES = [-1.5, 2.0]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]


def inputs():
    old = torch.zeros(2, 4, dtype=torch.float64)
    new = torch.tensor(LOG_RATIOS, dtype=torch.float64, requires_grad=True)
    return new, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


def hand_token_losses(clip_low, clip_high, clip_ratio_c):
    """Per-token losses and their d/d logp by explicit rules (verl's dual-clip formula)."""
    losses, grads = [[0.0] * 4 for _ in range(2)], [[0.0] * 4 for _ in range(2)]
    for i, advantage in enumerate(ADVANTAGES):
        for j in range(4):
            if not MASK[i][j]:
                continue
            ratio = math.exp(LOG_RATIOS[i][j])
            bounded = min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = max(-advantage * ratio, -advantage * bounded)
            grad = -advantage * ratio if -advantage * ratio >= -advantage * bounded else 0.0
            if clip_ratio_c and advantage < 0 and loss > -advantage * clip_ratio_c:
                loss, grad = -advantage * clip_ratio_c, 0.0
            losses[i][j], grads[i][j] = loss, grad
    return losses, grads


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clip_ratio_c", [0.0, 3.0])
def test_dual_clip_and_aggregation_match_hand_computation(mode, clip_ratio_c):
    new, old, advantages, mask = inputs()
    loss, metrics = clipped_surrogate_loss(new, old, advantages, mask, 0.2, 0.28, clip_ratio_c=clip_ratio_c,
                                           agg_mode=mode)
    loss.backward()
    losses, grads = hand_token_losses(0.2, 0.28, clip_ratio_c)
    lengths = [sum(row) for row in MASK]
    if mode == "token-mean":
        weights = [[1 / sum(lengths)] * 4] * 2
    elif mode == "seq-mean-token-mean":
        weights = [[1 / (2 * length)] * 4 for length in lengths]
    else:
        weights = [[1 / 2] * 4] * 2
    expected = sum(losses[i][j] * weights[i][j] for i in range(2) for j in range(4))
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    expected_grad = torch.tensor([[grads[i][j] * weights[i][j] for j in range(4)] for i in range(2)],
                                 dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected_grad, atol=1e-12, rtol=0)
    # ratio e^2 with A < 0: the dual clip caps that token at 3 * 1.5 instead of e^2 * 1.5.
    assert metrics["dual_clip_fraction"].item() == pytest.approx(0.25 if clip_ratio_c else 0.0)


def test_dual_clip_bounds_the_loss_of_a_large_ratio_with_negative_advantage():
    log_ratio = torch.tensor([[2.0]], dtype=torch.float64)
    advantage = torch.tensor([-1.0], dtype=torch.float64)
    plain, _ = clipped_surrogate_loss(log_ratio, torch.zeros(1, 1, dtype=torch.float64), advantage, torch.ones(1, 1))
    dual, _ = clipped_surrogate_loss(log_ratio, torch.zeros(1, 1, dtype=torch.float64), advantage, torch.ones(1, 1),
                                     clip_ratio_c=3.0)
    assert plain.item() == pytest.approx(math.exp(2.0)) and dual.item() == pytest.approx(3.0)
    assert plain.item() / dual.item() == pytest.approx(2.46, abs=0.01)  # the 2.4x the issue measured


def test_aggregation_counts_and_explicit_normalizer():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregation_count(mask, "token-mean").item() == 3
    assert aggregation_count(mask, "seq-mean-token-mean").item() == 2  # the empty row is no sequence
    values = torch.ones(3, 3)
    assert aggregate_loss(values, mask, "seq-mean-token-sum", normalizer=4.0).item() == pytest.approx(3 / 4)


@pytest.mark.parametrize("flags,message", [
    ({"clip_ratio_c": 0.5}, "--clip-ratio-c must be > 1"),
    ({"loss_agg_mode": "mean"}, "unknown --loss-agg-mode"),
    ({"num_minibatches": 0}, "--num-minibatches must be >= 1"),
    ({"ppo_epochs": 0}, "--ppo-epochs must be >= 1"),
])
def test_bad_settings_are_user_errors(flags, message):
    with pytest.raises(UserError, match=message):
        PolicyLossConfig(**flags)


def test_minibatches_cover_the_batch_and_never_come_out_empty():
    parts = split_minibatches(torch.arange(16), 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    short = split_minibatches(torch.arange(2), 4)
    assert len(short) == 4 and all(p.numel() == 1 for p in short)


def test_dynamic_sampling_keeps_groups_with_a_signal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # groups of 2: tied, mixed, tied, tied
    assert tied_groups(rewards, 2).tolist() == [True, False, True, True]
    assert kept_rows(rewards, 2, dynamic_sampling=False).tolist() == list(range(8))
    assert kept_rows(rewards, 2, dynamic_sampling=True).tolist() == [2, 3]
    # All tied on this replica: it keeps its first group (zero advantages) to take part in the step.
    assert kept_rows(torch.ones(4), 2, dynamic_sampling=True).tolist() == [0, 1]


def test_combined_step_metrics():
    steps = [{"success": True, "loss": 1.0, "ratio_max": 1.1, "kl_realized": None, "controller_time_s": 0.5},
             {"success": False, "loss": 3.0, "ratio_max": 1.4, "kl_realized": None, "controller_time_s": 0.25}]
    assert combine_steps(steps) == {"success": True, "loss": 2.0, "ratio_max": 1.4, "kl_realized": None,
                                    "controller_time_s": 0.75}
