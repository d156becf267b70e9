"""A ragged rollout batch laid out as the engines lay it out (left-padded prompts, right-padded
responses), for the packing tests in-process (tests/rl/test_packing.py) and under torchrun
(tests/workers/packing_checks.py)."""

import torch

from logra_megatron.rollout.types import Rollouts


def ragged_rollouts(prompt_lengths, response_lengths, vocab: int, seed: int = 0) -> Rollouts:
    """Random tokens in ``[1, vocab)`` (0 in the padding) for rows of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = torch.tensor(prompt_lengths), torch.tensor(response_lengths)
    rows, width = len(prompt_lengths), int(prompts.max())
    columns = torch.arange(width + int(responses.max()))
    attention = (columns >= width - prompts[:, None]) & (columns < width + responses[:, None])
    response = (columns >= width) & attention
    tokens = torch.randint(1, vocab, (rows, columns.numel()), generator=generator)
    tokens = torch.where(attention, tokens, torch.zeros_like(tokens))
    positions = (columns - (width - prompts[:, None])).clamp(min=0)
    return Rollouts(tokens=tokens, attention_mask=attention, response_mask=response, position_ids=positions,
                    prompt_lengths=prompts, response_lengths=responses, finished=torch.ones(rows, dtype=torch.bool),
                    prompt_index=torch.arange(rows), prompt_width=width, steps=int(responses.max()))
