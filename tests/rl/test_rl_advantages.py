"""GRPO group-normalized advantages against hand computations."""

import math

import pytest
import torch

from logra_megatron.errors import UserError
from logra_megatron.rl.advantages import AdvantageConfig, group_advantages

EPS = 1e-6


def test_population_std_by_default():
    # Group 1: mean 0.5, population std 0.5. Group 2: mean 2, squared deviations 1+0+1+0,
    # population std sqrt(2/4).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 2.0, 3.0, 2.0])
    advantages = group_advantages(rewards, AdvantageConfig(group_size=4, eps=EPS))
    std2 = math.sqrt(2 / 4)
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS),
                -1 / (std2 + EPS), 0.0, 1 / (std2 + EPS), 0.0]
    assert advantages.dtype == torch.float32 and advantages.shape == (8,)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_two_completions_get_plus_minus_one():
    advantages = group_advantages(torch.tensor([0.0, 1.0]), AdvantageConfig(group_size=2, eps=0.0))
    assert advantages.tolist() == [-1.0, 1.0]


def test_unbiased_std_divides_by_g_minus_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages = group_advantages(rewards, AdvantageConfig(group_size=4, unbiased_std=True, eps=EPS))
    std = math.sqrt(1 / 3)  # sum of squares 1.0 over G - 1 = 3
    a = 0.5 / (std + EPS)
    assert advantages.tolist() == pytest.approx([a, -a, -a, a], abs=1e-6)


def test_without_std_normalization_only_the_mean_is_removed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.2, 0.4, 0.6, 0.8]])
    advantages = group_advantages(rewards, AdvantageConfig(group_size=4, normalize_std=False))
    assert advantages.shape == (2, 4)  # a [num_prompts, G] input keeps its shape
    expected = [[0.75, -0.25, -0.25, -0.25], [-0.3, -0.1, 0.1, 0.3]]
    torch.testing.assert_close(advantages, torch.tensor(expected))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_identical_rewards_give_exactly_zero(normalize_std):
    # 0.1 is not exactly representable: r - mean(r) need not be exactly 0 in floating point.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0])
    config = AdvantageConfig(group_size=3, normalize_std=normalize_std)
    advantages = group_advantages(rewards, config)
    assert advantages[:6].tolist() == [0.0] * 6
    assert advantages[6:].abs().min().item() > 0.3


def test_group_of_one_is_zero_and_prompt_major_layout():
    assert group_advantages(torch.tensor([0.3, 1.0]), AdvantageConfig(group_size=1)).tolist() == [0.0, 0.0]
    # Completions of prompt p are at p*G .. p*G+G-1: reordering across groups changes the result.
    prompt_major = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), AdvantageConfig(group_size=2))
    assert prompt_major.tolist()[2:] == [0.0, 0.0] and prompt_major[0].item() > 0.99


def test_gradient_free_and_validation():
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not group_advantages(rewards, AdvantageConfig(group_size=2)).requires_grad
    with pytest.raises(UserError, match="whole groups"):
        group_advantages(torch.zeros(5), AdvantageConfig(group_size=2))
    with pytest.raises(UserError):
        AdvantageConfig(group_size=0)
    with pytest.raises(UserError):
        AdvantageConfig(group_size=1, unbiased_std=True)
    with pytest.raises(UserError):
        AdvantageConfig(eps=-1.0)
