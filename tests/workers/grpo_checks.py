"""GRPO's loss normalization over data-parallel ranks (2 gloo ranks, DP=2).

The same global batch of 8 sequences, whose halves have different numbers of response tokens,
is run twice: split over the two replicas (4 rows each), and whole on both replicas. Megatron's
DDP averages the gradients over replicas, so the two runs must give the same loss and the same
reduced gradients only if each replica divides by the *global* count (tokens, or sequences for
``seq-mean-*``): a replica-local divisor weighs the tokens of the shorter half more. Each check
returns the largest differences it saw and the scales they compare against.
"""

import torch
from common import Checks

from logra_megatron import parallel
from logra_megatron.models import get_preset
from logra_megatron.rl.grpo import policy_loss_backward, sequence_logprobs
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rollout.types import Rollouts
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
ROWS, PROMPT, RESPONSE = 8, 5, 6


def global_batch():
    """8 rows, prompts of 5 tokens, responses of 0..6 tokens: rows 0-3 short (one empty), rows 4-7 long."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, MODEL.vocab, (ROWS, PROMPT + RESPONSE), generator=generator)
    lengths = torch.tensor([1, 0, 1, 2, 6, 5, 6, 4])  # row 1 has no response: 3 vs 4 sequences
    columns = torch.arange(PROMPT + RESPONSE)
    response = (columns >= PROMPT) & (columns < PROMPT + lengths.unsqueeze(1))
    attention = columns < PROMPT + lengths.unsqueeze(1)
    tokens = torch.where(attention, tokens, torch.zeros_like(tokens))
    advantages = torch.randn(ROWS, generator=generator)
    return Rollouts(tokens=tokens, attention_mask=attention, response_mask=response,
                    position_ids=columns.expand(ROWS, -1).clone(), prompt_lengths=torch.full((ROWS,), PROMPT),
                    response_lengths=lengths, finished=torch.ones(ROWS, dtype=torch.bool),
                    prompt_index=torch.arange(ROWS), prompt_width=PROMPT, steps=RESPONSE), advantages


def loss_and_grads(rows, mode):
    parallel.initialize(1, 1, seed=5)
    model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="adam", lr=1e-3), None)
    rollouts, advantages = global_batch()
    rollouts, advantages = rollouts.select(rows), advantages[rows]
    old, _ = sequence_logprobs(ddp, rollouts, 2)
    # A policy a little away from the one that sampled, so the ratio is not 1 everywhere.
    shift = 0.3 * torch.sin(torch.arange(ROWS * old.shape[1], dtype=old.dtype)).reshape(ROWS, -1)
    old = old + shift[rows]
    ddp.zero_grad_buffer()
    metrics = policy_loss_backward(ddp, rollouts, advantages, old, 2, PolicyLossConfig(loss_agg_mode=mode))
    grads = torch.cat([p.main_grad.detach().flatten().clone() for p in ddp.parameters()])
    return metrics["loss"], grads


def same_batch_split_or_whole(mode):
    half = ROWS // 2
    split_loss, split_grads = loss_and_grads(torch.arange(half) + half * parallel.dp_rank(), mode)
    whole_loss, whole_grads = loss_and_grads(torch.arange(ROWS), mode)
    return {"loss_diff": abs(split_loss - whole_loss), "loss": whole_loss,
            "grad_diff": float((split_grads - whole_grads).abs().max()),
            "grad_scale": float(whole_grads.abs().max()), "dp": parallel.dp_size()}


def main():
    checks = Checks()
    parallel.initialize(1, 1, seed=5)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        checks.run(mode, same_batch_split_or_whole, mode)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
