"""GRPO group-normalized advantages.

GRPO samples ``G`` completions per prompt and uses the group as its own baseline instead of a
learned value function: the advantage of completion ``i`` of a prompt is

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

and every response token of the completion gets that same ``A_i``.

Choices:

- **Layout.** Rewards arrive flat, ``[num_prompts * G]``, prompt-major: the ``G`` completions
  of prompt ``p`` sit at ``p*G .. p*G+G-1`` (the order the rollout produces them). A
  ``[num_prompts, G]`` tensor is accepted too; the output has the input's shape.
- **Population std by default** (divide by ``G``, ``unbiased_std=False``): a group of two with
  rewards ``{0, 1}`` gets advantages ``-1, +1``, and a group of one gets std 0 rather than NaN.
  ``unbiased_std=True`` divides by ``G - 1`` as ``torch.std`` does by default (the convention of
  TRL and verl), which scales every advantage by ``sqrt((G-1)/G)``.
- **Identical rewards give exactly zero advantage.** A group where every completion scored the
  same carries no signal about which is better; its advantages are set to 0 exactly rather than
  left to floating-point rounding of ``r - mean`` (which need not be exactly 0).
- **Optional std normalization** (``normalize_std=False`` gives ``A = r - mean``): dividing by
  the group std up-weights prompts whose rewards barely differ (too easy or too hard), a bias
  that Dr. GRPO ("Understanding R1-Zero-like training", Liu et al. 2025) argues against.
- Computed in float64 and returned as float32, so the normalization itself adds no rounding
  visible at training precision.
"""

from dataclasses import dataclass

import torch

from logra_megatron.errors import UserError
from logra_megatron.schema import option


@dataclass(frozen=True)
class AdvantageConfig:
    """How group rewards become advantages. Validated on construction."""

    group_size: int = option(8, help="G: completions sampled per prompt; the rewards tensor holds whole groups")
    normalize_std: bool = option(True, flag="--no-std-normalization", negative=True,
                                 help="do not divide group-centred rewards by the group's std "
                                      "(Dr. GRPO's mean-only baseline)")
    dynamic_sampling: bool = option(False, help="drop groups whose completions all scored the same (DAPO's "
                                                "dynamic sampling): the batch shrinks to the groups with a "
                                                "learning signal; the share of tied groups is logged either way")
    unbiased_std: bool = False
    """Use the ``G - 1`` (Bessel) std instead of the population (``G``) std."""
    eps: float = 1e-6
    """Added to the std before dividing, bounding advantages of nearly-tied groups."""

    def __post_init__(self):
        if self.group_size < 1:
            raise UserError(f"--group-size must be >= 1, got {self.group_size}")
        if self.unbiased_std and self.normalize_std and self.group_size < 2:
            raise UserError("the unbiased std needs a group size of at least 2")
        if self.eps < 0:
            raise UserError(f"advantage eps must be >= 0, got {self.eps}")


def group_advantages(rewards: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """Per-completion GRPO advantages of ``rewards`` (``[num_prompts * G]`` or ``[num_prompts, G]``).

    Returns a float32 tensor of the input's shape.
    """
    # A list of rewards (host floats, tests) becomes a CPU tensor; a tensor keeps its device.
    rewards = torch.as_tensor(rewards)
    group_size = config.group_size
    if rewards.numel() % group_size != 0:
        raise UserError(
            f"{rewards.numel()} rewards do not form whole groups of {group_size} completions"
        )
    groups = rewards.detach().to(torch.float64).reshape(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if config.normalize_std:
        std = groups.std(dim=1, keepdim=True, unbiased=config.unbiased_std) if group_size > 1 \
            else torch.zeros_like(centered[:, :1])
        advantages = centered / (std + config.eps)
    else:
        advantages = centered
    tied = (groups.amax(dim=1) == groups.amin(dim=1)).unsqueeze(1)
    advantages = torch.where(tied, torch.zeros_like(advantages), advantages)
    return advantages.to(torch.float32).reshape(rewards.shape)
