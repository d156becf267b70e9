"""Token balancing over data-parallel replicas (2 gloo ranks, DP=2; tests/rl/test_balancing.py).

Each replica holds 4 rows of its own layout: replica 0 long rows (prompt width 5, up to 6
completion tokens), replica 1 short ones (prompt width 3, left-padded prompts, up to 2 completion
tokens), so the two batches differ in width and in tokens (41 vs 13) and balancing must move rows
and re-pad them. A row's identity is its global index (carried as its prompt index; replica 1's
prompts come after replica 0's). Two minibatches per step, as ``--num-minibatches 2`` splits them.

Checks: ``rows`` (the rows over both replicas after the exchange are those before, each once,
each replica keeps its row count per minibatch); per loss aggregation, the loss and the reduced
gradient of each minibatch with balancing against those without it.
"""

import torch
import torch.distributed as dist
from common import Checks

from logra_megatron import parallel
from logra_megatron.models import get_preset
from logra_megatron.rl.balancing import balance_batch
from logra_megatron.rl.grpo import policy_loss_backward, sequence_logprobs
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rl.minibatches import select_rows, split_minibatches
from logra_megatron.rollout.types import Rollouts
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
ROWS, MINIBATCHES, PAD = 4, 2, 0
# per replica: prompt width, prompt lengths, completion columns, response lengths
LAYOUTS = [(5, [5, 5, 4, 5], 6, [6, 5, 6, 4]), (3, [3, 2, 3, 1], 3, [1, 0, 2, 1])]


def replica_batch(rank):
    """This replica's rows (left-padded prompts, right-padded completions) and advantages."""
    width, prompts, completion, responses = LAYOUTS[rank]
    generator = torch.Generator().manual_seed(11 + rank)
    columns = torch.arange(width + completion)
    prompt_len, response_len = torch.tensor(prompts), torch.tensor(responses)
    prompt = (columns < width) & (columns >= width - prompt_len.unsqueeze(1))
    response = (columns >= width) & (columns < width + response_len.unsqueeze(1))
    attention = prompt | response
    tokens = torch.randint(1, MODEL.vocab, (ROWS, width + completion), generator=generator)
    tokens = torch.where(attention, tokens, torch.full_like(tokens, PAD))
    positions = (attention.long().cumsum(dim=1) - 1).clamp(min=0) * attention
    advantages = torch.randn(ROWS, generator=generator)
    return Rollouts(tokens=tokens, attention_mask=attention, response_mask=response, position_ids=positions,
                    prompt_lengths=prompt_len, response_lengths=response_len,
                    finished=torch.ones(ROWS, dtype=torch.bool), prompt_index=torch.arange(ROWS),
                    prompt_width=width, steps=completion), advantages


def signatures(batch, advantages, ids):
    """Every row over both replicas as (id, real tokens, response tokens, advantage), sorted."""
    mine = [(int(g), batch.tokens[b][batch.attention_mask[b]].tolist(),
             batch.tokens[b][batch.response_mask[b]].tolist(), round(float(advantages[b]), 6))
            for b, g in enumerate(ids)]
    everyone = [None] * parallel.dp_size()
    dist.all_gather_object(everyone, mine, group=parallel.dp_group())
    return sorted(row for rows in everyone for row in rows)


def rows_check():
    batch, advantages = replica_batch(parallel.dp_rank())
    balanced, moved_advantages, metrics = balance_batch(batch, advantages, MINIBATCHES, PAD)
    before = signatures(batch, advantages, batch.prompt_index + ROWS * parallel.dp_rank())
    after = signatures(balanced, moved_advantages, balanced.prompt_index)
    return {"before": before, "after": after,
            "moved": sum(a != b for a, b in zip(balanced.prompt_index.tolist(),
                                                (batch.prompt_index + ROWS * parallel.dp_rank()).tolist())),
            "ratio_before": metrics["dp_token_ratio_before"], "ratio_after": metrics["dp_token_ratio"],
            "counts_kept": balanced.num_sequences == batch.num_sequences}


def old_logprobs(ddp, batch, ids):
    """Old log-probs a little away from the policy (a shift per row, by its identity), so the
    ratio is not 1 and the clip acts on some rows."""
    old, _ = sequence_logprobs(ddp, batch, 2)
    shift = 0.3 * torch.sin(ids.double() + 1.0).to(old.dtype)
    return old + shift.unsqueeze(1) * batch.response_mask[:, 1:]


def minibatch_losses(ddp, batch, advantages, ids, mode):
    """(loss, reduced gradient) of each of the step's minibatches, as the trainer runs them."""
    old = old_logprobs(ddp, batch, ids)
    out = []
    for part in split_minibatches(torch.arange(batch.num_sequences), MINIBATCHES):
        rows, adv, old_part = select_rows(batch, part, advantages, old)
        ddp.zero_grad_buffer()
        metrics = policy_loss_backward(ddp, rows, adv, old_part, 2, PolicyLossConfig(loss_agg_mode=mode))
        out.append((metrics["loss"], torch.cat([p.main_grad.detach().flatten().clone() for p in ddp.parameters()])))
    return out


def balanced_equals_unbalanced(ddp, mode):
    batch, advantages = replica_batch(parallel.dp_rank())
    balanced, moved_advantages, _ = balance_batch(batch, advantages, MINIBATCHES, PAD)
    plain = minibatch_losses(ddp, batch, advantages, batch.prompt_index + ROWS * parallel.dp_rank(), mode)
    spread = minibatch_losses(ddp, balanced, moved_advantages, balanced.prompt_index, mode)
    return {"loss_diff": max(abs(a[0] - b[0]) for a, b in zip(plain, spread)),
            "loss": max(abs(a[0]) for a in plain),
            "grad_diff": max(float((a[1] - b[1]).abs().max()) for a, b in zip(plain, spread)),
            "grad_scale": max(float(a[1].abs().max()) for a in plain),
            "moved": int((balanced.prompt_index != batch.prompt_index + ROWS * parallel.dp_rank()).sum())}


def main():
    checks = Checks()
    parallel.initialize(1, 1, seed=5)
    torch.manual_seed(5)
    _model, ddp, _optimizer = build_trainable(MODEL, OptimizerSettings(kind="adam", lr=1e-3), None)
    checks.run("rows", rows_check)
    for mode in ("token-mean", "seq-mean-token-sum"):
        checks.run(mode, balanced_equals_unbalanced, ddp, mode)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
