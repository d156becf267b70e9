"""GRPO's two passes over a batch of rollouts through Megatron's pipeline schedule.

- :func:`sequence_logprobs`: per-token log-probs (and entropy) of the sampled tokens, forward
  only (old-policy and reference log-probs).
- :func:`policy_loss_backward`: the clipped-surrogate loss (plus optional KL-to-reference and
  entropy terms), forward and backward over microbatches; gradients (or LoGRA sketches)
  accumulate in the model.

Both read the logits vocab-parallel ([b, s, V/tp] on the last stage) and never gather the
vocabulary. Rollouts are left-padded; each model call gets the padding-aware causal mask and
per-row rotary positions (:func:`~logra_megatron.models.positions.rope_positions`). The loss is
divided by the count (response tokens, or sequences for the ``seq-mean-*`` aggregations) of the
optimizer step's whole batch over every data-parallel replica, so it is the global mean and does
not depend on how the batch is split into microbatches or over ranks.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from logra_megatron import parallel
from logra_megatron.models.build import model_device
from logra_megatron.ops.vocab_parallel import vocab_parallel_logprobs_and_entropy
from logra_megatron.rl.losses import PolicyLossConfig, aggregation_count, policy_loss
from logra_megatron.rollout.types import Rollouts
from logra_megatron.training.kl_control import ProbeSet
from logra_megatron.training.lm import padded_forward


# Metrics that policy_loss divides by the batch's count (sum them over microbatches); ratio_max
# is a maximum; the others are per-microbatch means (weighted by the microbatch's share of tokens).
_NORMALIZED_BY_BATCH_COUNT = ("loss", "pg_loss", "kl")
_MAXIMA = ("ratio_max",)


def _microbatches(rollouts: Rollouts, micro_batch_size: int, extra: dict, device: torch.device):
    """The batch's rows in microbatches, each tensor on the model's ``device`` (a no-op for
    rollouts an engine produced there; rewards and advantages come from the host)."""
    rows = rollouts.tokens.shape[0]
    for start in range(0, rows, micro_batch_size):
        part = slice(start, start + micro_batch_size)
        yield {
            "tokens": rollouts.tokens[part].to(device),
            "attention_mask": rollouts.attention_mask[part].to(device),
            "position_ids": rollouts.position_ids[part].to(device),
            "response_mask": rollouts.response_mask[part].to(device),
            **{key: value[part].to(device) if value is not None else None for key, value in extra.items()},
        }


def _run(model, rollouts, micro_batch_size, loss_func_for, forward_only, extra=None, vocab_size=None):
    batches = list(_microbatches(rollouts, micro_batch_size, extra or {}, model_device(model)))

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = padded_forward(model, batch["tokens"], batch["attention_mask"], batch["position_ids"], vocab_size)
        return logits, loss_func_for(batch, len(batches))

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=rollouts.tokens.shape[1],
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def _targets(batch):
    return batch["tokens"][:, 1:], batch["response_mask"][:, 1:].float()


@torch.no_grad()
def sequence_logprobs(model, rollouts: Rollouts, micro_batch_size: int, temperature: float = 1.0,
                      vocab_size: Optional[int] = None):
    """``(logprobs, entropy)`` of shape ``[B, S-1]`` (position t scores token t+1), identical on
    every rank of the data-parallel replica (computed on the last stage, broadcast over PP)."""
    def loss_func_for(batch, _):
        def loss_func(logits):
            targets, _mask = _targets(batch)
            logprob, entropy = vocab_parallel_logprobs_and_entropy(
                logits[:, :-1], targets, temperature=temperature, group=parallel.tp_group())
            return logits.float().sum() * 0, {"logprob": logprob.float(), "entropy": entropy.float()}
        return loss_func

    outputs = _run(model, rollouts, micro_batch_size, loss_func_for, forward_only=True, vocab_size=vocab_size)
    shape = (rollouts.tokens.shape[0], rollouts.tokens.shape[1] - 1)
    device = model_device(model)
    logprobs = torch.zeros(shape, device=device)
    entropy = torch.zeros(shape, device=device)
    if parallel.is_last_stage():
        logprobs = torch.cat([item["logprob"] for item in outputs])
        entropy = torch.cat([item["entropy"] for item in outputs])
    both = parallel.broadcast_from_last_stage(torch.stack([logprobs, entropy]))
    return both[0], both[1]


def policy_loss_backward(model, rollouts: Rollouts, advantages: torch.Tensor,
                         old_logprobs: torch.Tensor, micro_batch_size: int,
                         loss_config: PolicyLossConfig, ref_logprobs: Optional[torch.Tensor] = None,
                         temperature: float = 1.0, vocab_size: Optional[int] = None,
                         engine_logprobs: Optional[torch.Tensor] = None) -> dict:
    """Forward + backward of the GRPO loss over microbatches. Returns metrics averaged over the
    batch (agreed on every rank): loss, pg_loss, clip_fraction, dual_clip_fraction, ratio_mean,
    ratio_max, entropy, kl (if on), tis_weight_mean (with ``--tis-cap`` and ``engine_logprobs``,
    the rollout engine's log-probs laid out like ``old_logprobs``)."""
    device = model_device(model)
    response_tokens = rollouts.response_mask[:, 1:].to(device).float().sum().clamp(min=1)
    # Megatron's DDP (and LoGRA's sketch reduction) average gradients over data-parallel
    # replicas, so each rank divides by the global count / dp: the average is the global mean.
    count = aggregation_count(rollouts.response_mask[:, 1:].to(device), loss_config.loss_agg_mode).double()
    if parallel.dp_size() > 1:
        dist.all_reduce(count, group=parallel.dp_group())
    normalizer = float(count.clamp(min=1)) / parallel.dp_size()
    extra = {"advantages": advantages, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
             "engine_logprobs": engine_logprobs}

    def loss_func_for(batch, num_microbatches):
        def loss_func(logits):
            targets, mask = _targets(batch)
            logprob, entropy = vocab_parallel_logprobs_and_entropy(
                logits[:, :-1], targets, temperature=temperature, group=parallel.tp_group())
            loss, metrics = policy_loss(
                logprob, batch["old_logprobs"], batch["advantages"], mask, loss_config,
                ref_logprobs=batch["ref_logprobs"], entropy=entropy, normalizer=normalizer,
                engine_logprobs=batch["engine_logprobs"])
            weight = mask.sum() / response_tokens
            reported = {"loss": loss.detach().float(), "weight": weight,
                        "entropy": (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)}
            for key in ("pg_loss", "kl", "clip_fraction", "dual_clip_fraction", "ratio_mean", "ratio_max",
                        "tis_weight_mean"):
                if key in metrics:
                    reported[key] = metrics[key].detach().float()
            # Megatron divides a 2-tuple loss by the number of microbatches; undo that, the
            # normalizer above already makes the microbatch losses sum to the batch loss.
            return loss * num_microbatches, reported
        return loss_func

    outputs = _run(model, rollouts, micro_batch_size, loss_func_for, forward_only=False, extra=extra,
                   vocab_size=vocab_size)
    summary = {}
    if parallel.is_last_stage():
        keys = [key for key in outputs[0] if key != "weight"]
        for key in keys:
            if key in _NORMALIZED_BY_BATCH_COUNT:  # already a share of the batch mean
                summary[key] = float(sum(item[key] for item in outputs))
            elif key in _MAXIMA:
                summary[key] = float(max(item[key] for item in outputs))
            else:
                summary[key] = float(sum(item[key] * item["weight"] for item in outputs))
    names = parallel.broadcast_object_from_last_stage(sorted(summary) if parallel.is_last_stage() else None)
    return {name: parallel.agree_on_scalar(summary.get(name, 0.0), op="max" if name in _MAXIMA else "mean")
            for name in names}


def probe_rows(rollouts: Rollouts, count: int, offset: float = 0.0) -> torch.Tensor:
    """``count`` row indices spread evenly over the batch, so the KL probe sees as many
    different prompts as it can (rows of one prompt are adjacent). ``offset`` (in [0, 1))
    shifts them by that fraction of the spacing: 0.5 gives rows between the probe's."""
    total = rollouts.tokens.shape[0]
    count = min(count, total)
    spread = (torch.arange(count, device=rollouts.tokens.device) + offset) * total
    return torch.div(spread, count, rounding_mode="floor").long()


def probe_set(rollouts: Rollouts, rows: torch.Tensor, micro_batch_size: int, vocab_size: Optional[int]) -> ProbeSet:
    """The KL controller's view of some rollouts: their own padding mask and positions, and
    the response positions (position t predicts token t + 1) as the tokens that count."""
    mask = torch.zeros(len(rows), rollouts.tokens.shape[1], device=rollouts.tokens.device)
    mask[:, :-1] = rollouts.response_mask[rows, 1:].float()
    return ProbeSet(tokens=rollouts.tokens[rows], mask=mask, attention_mask=rollouts.attention_mask[rows],
                    position_ids=rollouts.position_ids[rows], vocab_size=vocab_size,
                    micro_batch_size=max(1, min(micro_batch_size, len(rows))))


def probe_and_held_out(rollouts: Rollouts, count: int, micro_batch_size: int,
                       vocab_size: Optional[int]) -> Tuple[ProbeSet, Optional[ProbeSet]]:
    """The probe (``count`` rows spread over the batch's prompts) and as many other rows, half a
    spacing further, for the realized KL out of sample (None when the batch has no room)."""
    probe = probe_rows(rollouts, count)
    held_out = probe_rows(rollouts, count, offset=0.5)
    held_out = held_out[~torch.isin(held_out, probe)]
    return (probe_set(rollouts, probe, micro_batch_size, vocab_size),
            probe_set(rollouts, held_out, micro_batch_size, vocab_size) if len(held_out) else None)
