"""One rollout batch -> several optimizer steps (GRPO/PPO minibatches and epochs), and DAPO's
dynamic sampling of groups.

Old log-probs are computed once per batch, before the first step, so from the second step on
the policy has moved away from the one that sampled and the clipped surrogate's ratio departs
from 1 (that is when clipping acts). Each step is one KL-controlled optimizer step.
"""

from typing import Dict, List, Optional

import torch

from logra_megatron.rollout.types import Rollouts


def tied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_prompts]`` bool: groups whose completions all scored the same (zero advantage,
    no learning signal)."""
    groups = rewards.reshape(-1, group_size)
    return groups.amax(dim=1) == groups.amin(dim=1)


def kept_rows(rewards: torch.Tensor, group_size: int, dynamic_sampling: bool) -> torch.Tensor:
    """Row indices that enter the loss: every row, or with ``--dynamic-sampling`` the rows of
    groups whose rewards differ (DAPO). A replica left with none keeps its first group (its
    advantages are 0): every data-parallel rank must take part in each optimizer step's
    collectives, and a zero-advantage group adds nothing to the gradient."""
    rows = torch.arange(rewards.numel(), device=rewards.device)
    if not dynamic_sampling:
        return rows
    keep = (~tied_groups(rewards, group_size)).repeat_interleave(group_size)
    return rows[keep] if keep.any() else rows[:group_size]


def split_minibatches(rows: torch.Tensor, count: int) -> List[torch.Tensor]:
    """``rows`` in ``count`` contiguous, nearly equal parts (whole groups stay together when the
    sizes divide). A batch with fewer rows than ``count`` repeats its last rows rather than
    returning an empty part, so every rank takes the same number of steps."""
    parts = list(torch.tensor_split(rows, count))
    for index, part in enumerate(parts):
        if part.numel() == 0:
            parts[index] = rows[-1:]
    return parts


def select_rows(rollouts: Rollouts, rows: torch.Tensor, *tensors: Optional[torch.Tensor]):
    """``(rollouts restricted to rows, *each tensor's rows)`` (None stays None)."""
    return (rollouts.select(rows), *(None if t is None else t[rows] for t in tensors))


def combine_steps(steps: List[Dict[str, Optional[float]]]) -> Dict[str, Optional[float]]:
    """Metrics of a batch's optimizer steps as one row: the mean of each figure over the steps
    that have it (the maximum for ``ratio_max``, the total for times), ``success`` if any step
    committed."""
    combined: Dict[str, Optional[float]] = {}
    for key in steps[0]:
        values = [step[key] for step in steps if step.get(key) is not None]
        if key == "success":
            combined[key] = any(values)
        elif not values:
            combined[key] = None
        elif key == "ratio_max":
            combined[key] = max(values)
        elif key.endswith("_time_s"):
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    return combined
