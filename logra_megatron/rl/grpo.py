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

Packed (``pack=True``, the trainer's default; ``--no-pack-sequences`` turns it off): the rows are
bin-packed into microbatches of at most ``max_tokens`` real tokens (:mod:`~logra_megatron.rl.packing`),
each microbatch one ``[1, t]`` packed sequence (:func:`~logra_megatron.models.positions.pack_rows`),
so no padding is computed. The per-token log-probs come back in the padded ``[b, S-1]`` layout
of the microbatch's rows, and the loss is the same function of them.
"""

import dataclasses
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.models.build import model_device, unwrap_model
from logra_megatron.models.positions import pack_rows
from logra_megatron.ops.multiples import round_up
from logra_megatron.ops.vocab_parallel import vocab_parallel_logprobs_and_entropy
from logra_megatron.rl.losses import PolicyLossConfig, aggregation_count, policy_loss
from logra_megatron.rollout.types import Rollouts
from logra_megatron.training.kl_control import ProbeSet
from logra_megatron.rl.packing import default_token_budget, token_bins
from logra_megatron.training.lm import model_chunks, packed_forward, padded_forward, pipeline_pass


# Metrics that policy_loss divides by the batch's count (sum them over microbatches); ratio_max
# is a maximum; the others are per-microbatch means (weighted by the microbatch's share of tokens).
_NORMALIZED_BY_BATCH_COUNT = ("loss", "pg_loss", "kl")
_MAXIMA = ("ratio_max",)


def sequence_multiple(model) -> int:
    """What every sequence length ``model`` runs on must divide by: the TP size under Megatron's
    sequence parallelism (the activations are split along the sequence over TP), else 1.
    ``model``: one chunk or this rank's list of them (a virtual pipeline)."""
    return parallel.tp_size() if unwrap_model(model_chunks(model)[0]).config.sequence_parallel else 1


def widen_to_multiple(rollouts: Rollouts, multiple: int) -> Rollouts:
    """``rollouts`` left-padded by as few columns as make their width a multiple of ``multiple``
    (the padded passes under sequence parallelism). The new columns are masked padding (token 0,
    position 0, no log-prob), so every row computes what it did: each attends to its own real
    tokens at its own rotary positions."""
    extra = -rollouts.tokens.shape[1] % multiple
    if extra == 0:
        return rollouts

    def left(tensor):
        return None if tensor is None else torch.cat([tensor.new_zeros(tensor.shape[0], extra), tensor], dim=1)

    return dataclasses.replace(
        rollouts, tokens=left(rollouts.tokens), attention_mask=left(rollouts.attention_mask),
        response_mask=left(rollouts.response_mask), position_ids=left(rollouts.position_ids),
        logprobs=left(rollouts.logprobs), prompt_width=rollouts.prompt_width + extra)


def _microbatches(rollouts: Rollouts, micro_batch_size: int, extra: dict, device: torch.device):
    """The batch's rows in microbatches, each tensor on the model's ``device`` (a no-op for
    rollouts an engine produced there; rewards and advantages come from the host)."""
    rows = rollouts.tokens.shape[0]
    for start in range(0, rows, micro_batch_size):
        part = slice(start, start + micro_batch_size)
        yield {
            "rows": torch.arange(start, min(start + micro_batch_size, rows), device=device),
            "tokens": rollouts.tokens[part].to(device),
            "attention_mask": rollouts.attention_mask[part].to(device),
            "position_ids": rollouts.position_ids[part].to(device),
            "response_mask": rollouts.response_mask[part].to(device),
            **{key: value[part].to(device) if value is not None else None for key, value in extra.items()},
        }


def packed_lengths(real_tokens: list, multiple: int) -> list:
    """The length each packed microbatch is filled to, from its real tokens: under a pipeline the
    longest one's (the stages exchange activations of one shape in a schedule call), rounded up
    to ``multiple`` (:func:`sequence_multiple`: sequence parallelism splits it over TP)."""
    common = max(real_tokens) if parallel.pp_size() > 1 else None
    return [round_up(common or total, multiple) for total in real_tokens]


def _packed_microbatches(model, rollouts: Rollouts, max_tokens: int, extra: dict, device: torch.device):
    """The batch's rows bin-packed into microbatches of at most ``max_tokens`` real tokens, each
    with its rows' padded tensors (for the loss), their indices (``rows``) and the packed
    sequence (``packed``). With a pipeline every microbatch is filled to the same length (the
    stages exchange activations of one shape); with sequence parallelism to a multiple of TP."""
    lengths = rollouts.attention_mask.sum(dim=1).tolist()
    bins = token_bins(lengths, max_tokens)
    pad_to = packed_lengths([sum(lengths[row] for row in rows) for rows in bins], sequence_multiple(model))
    for rows, length in zip(bins, pad_to):
        index = torch.tensor(rows, dtype=torch.long, device=rollouts.tokens.device)
        batch = {
            "rows": index.to(device),
            "tokens": rollouts.tokens[index].to(device),
            "attention_mask": rollouts.attention_mask[index].to(device),
            "response_mask": rollouts.response_mask[index].to(device),
            **{key: value[index.to(value.device)].to(device) if value is not None else None
               for key, value in extra.items()},
        }
        batch["packed"] = pack_rows(batch["tokens"], batch["attention_mask"], pad_to=length)
        yield batch


def _run(model, rollouts, micro_batch_size, loss_func_for, forward_only, extra=None, vocab_size=None,
         pack=False, max_tokens=0):
    device = model_device(model_chunks(model)[0])
    if pack:
        budget = max_tokens or default_token_budget(micro_batch_size, rollouts.tokens.shape[1])
        batches = list(_packed_microbatches(model, rollouts, budget, extra or {}, device))
        seq_length, rows_per_call = batches[0]["packed"].tokens.shape[1], 1
    else:
        batches = list(_microbatches(rollouts, micro_batch_size, extra or {}, device))
        seq_length, rows_per_call = rollouts.tokens.shape[1], micro_batch_size
        multiple = sequence_multiple(model)
        if seq_length % multiple:  # (the trainer widens them: widen_to_multiple)
            raise ValueError(f"rollouts of width {seq_length} cannot be split over {multiple} "
                             "sequence-parallel ranks; widen them with widen_to_multiple")

    def forward_step(batch, model, num_microbatches):  # (model: one chunk)
        if pack:
            logits = packed_forward(model, batch["packed"], vocab_size)
        else:
            logits = padded_forward(model, batch["tokens"], batch["attention_mask"], batch["position_ids"],
                                    vocab_size)
        return logits, loss_func_for(batch, num_microbatches)

    return pipeline_pass(model, forward_step, batches, seq_length=seq_length, micro_batch_size=rows_per_call,
                         forward_only=forward_only)


def _targets(batch):
    return batch["tokens"][:, 1:], batch["response_mask"][:, 1:].float()


def _token_logprobs(logits, batch, temperature):
    """``(log-prob, entropy)`` ``[b, S-1]`` of the microbatch's rows (column t scores token t+1)
    from its logits, padded ``[b, S, V/tp]`` or packed ``[1, t, V/tp]`` (0 where no real token
    predicts a real one)."""
    packed = batch.get("packed")
    if packed is None:
        targets, _ = _targets(batch)
        return vocab_parallel_logprobs_and_entropy(logits[:, :-1], targets, temperature=temperature,
                                                   group=parallel.tp_group())
    logprob, entropy = vocab_parallel_logprobs_and_entropy(logits, packed.next_tokens(), temperature=temperature,
                                                           group=parallel.tp_group())
    rows, columns = batch["tokens"].shape
    shape = (rows, columns - 1)
    return packed.unpack(logprob, shape), packed.unpack(entropy, shape)


@torch.no_grad()
def sequence_logprobs(model, rollouts: Rollouts, micro_batch_size: int, temperature: float = 1.0,
                      vocab_size: Optional[int] = None, pack: bool = False, max_tokens: int = 0):
    """``(logprobs, entropy)`` of shape ``[B, S-1]`` (position t scores token t+1), identical on
    every rank of the data-parallel replica (computed on the last stage, broadcast over PP).
    ``pack``: packed microbatches of at most ``max_tokens`` real tokens (0: ``micro_batch_size``
    rows' worth); then 0 at the positions that do not score a real token."""
    def loss_func_for(batch, _):
        def loss_func(logits):
            logprob, entropy = _token_logprobs(logits, batch, temperature)
            reported = {"logprob": logprob.float(), "entropy": entropy.float()}
            if "rows" in batch:
                reported["rows"] = batch["rows"]
            return logits.float().sum() * 0, reported
        return loss_func

    outputs = _run(model, rollouts, micro_batch_size, loss_func_for, forward_only=True, vocab_size=vocab_size,
                   pack=pack, max_tokens=max_tokens)
    shape = (rollouts.tokens.shape[0], rollouts.tokens.shape[1] - 1)
    device = model_device(model_chunks(model)[0])
    logprobs = torch.zeros(shape, device=device)
    entropy = torch.zeros(shape, device=device)
    if parallel.is_last_stage():
        if pack:  # rows come back in their microbatches' order
            rows = torch.cat([item["rows"] for item in outputs])
            logprobs[rows] = torch.cat([item["logprob"] for item in outputs])
            entropy[rows] = torch.cat([item["entropy"] for item in outputs])
        else:
            logprobs = torch.cat([item["logprob"] for item in outputs])
            entropy = torch.cat([item["entropy"] for item in outputs])
    both = parallel.broadcast_from_last_stage(torch.stack([logprobs, entropy]))
    return both[0], both[1]


def policy_loss_backward(model, rollouts: Rollouts, advantages: torch.Tensor,
                         old_logprobs: torch.Tensor, micro_batch_size: int,
                         loss_config: PolicyLossConfig, ref_logprobs: Optional[torch.Tensor] = None,
                         temperature: float = 1.0, vocab_size: Optional[int] = None,
                         engine_logprobs: Optional[torch.Tensor] = None, pack: bool = False,
                         max_tokens: int = 0, keep_logits=None) -> dict:
    """Forward + backward of the GRPO loss over microbatches. Returns metrics averaged over the
    batch (agreed on every rank): loss, pg_loss, clip_fraction, dual_clip_fraction, ratio_mean,
    ratio_max, entropy, kl (if on), tis_weight_mean (with ``--tis-cap`` and ``engine_logprobs``,
    the rollout engine's log-probs laid out like ``old_logprobs``). ``keep_logits`` (the KL
    controller's ``StepLogits``) is shown each microbatch's rows and logits on the last stage."""
    device = model_device(model_chunks(model)[0])
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
            if keep_logits is not None:
                keep_logits(batch["rows"], logits, batch.get("packed"))
            _, mask = _targets(batch)
            logprob, entropy = _token_logprobs(logits, batch, temperature)
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
                   vocab_size=vocab_size, pack=pack, max_tokens=max_tokens)
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


def probe_set(rollouts: Rollouts, rows: torch.Tensor, micro_batch_size: int, vocab_size: Optional[int],
              pack: bool = False, max_tokens: int = 0, multiple: int = 1) -> ProbeSet:
    """The KL controller's view of some rollouts: their own padding mask and positions, and
    the response positions (position t predicts token t + 1) as the tokens that count. With
    ``pack`` the rows are bin-packed as the GRPO passes pack them (at most ``max_tokens`` real
    tokens a part; 0: ``micro_batch_size`` rows' worth), so the probe's forward passes compute
    no padding but filler to a multiple of ``multiple`` tokens (:func:`sequence_multiple`; the
    padded rows must already be as wide as that: :func:`widen_to_multiple`); under a pipeline
    every packed part is filled to the longest part's length."""
    mask = torch.zeros(len(rows), rollouts.tokens.shape[1], device=rollouts.tokens.device)
    mask[:, :-1] = rollouts.response_mask[rows, 1:].float()
    micro_batch_size = max(1, min(micro_batch_size, len(rows)))
    tokens, attention_mask = rollouts.tokens[rows], rollouts.attention_mask[rows]
    packed = packed_rows = None
    if pack:
        budget = max_tokens or default_token_budget(micro_batch_size, tokens.shape[1])
        packed, packed_rows = [], []
        lengths = attention_mask.sum(dim=1).tolist()
        bins = token_bins(lengths, budget)
        # the parts go through one schedule call together (ProbeSet.each_logits)
        fills = packed_lengths([sum(lengths[row] for row in rows) for rows in bins], multiple)
        for part, fill in zip(bins, fills):
            index = torch.tensor(part, dtype=torch.long, device=tokens.device)
            rows_packed = pack_rows(tokens[index], attention_mask[index], pad_to=fill)
            part_mask = torch.zeros_like(rows_packed.tokens, dtype=mask.dtype)
            real = mask[index][rows_packed.rows, rows_packed.slots] * rows_packed.predicts
            part_mask[0, :rows_packed.real_tokens] = real
            packed.append((rows_packed, part_mask))
            packed_rows.append(index)
    return ProbeSet(tokens=tokens, mask=mask, attention_mask=attention_mask,
                    position_ids=rollouts.position_ids[rows], vocab_size=vocab_size,
                    micro_batch_size=micro_batch_size, packed=packed, packed_rows=packed_rows, rows=rows)


def probe_and_held_out(rollouts: Rollouts, count: int, micro_batch_size: int, vocab_size: Optional[int],
                       pack: bool = False, max_tokens: int = 0,
                       multiple: int = 1) -> Tuple[ProbeSet, Optional[ProbeSet]]:
    """The probe (``count`` rows spread over the batch's prompts) and as many other rows, half a
    spacing further, for the realized KL out of sample (None when the batch has no room);
    ``pack``, ``max_tokens``, ``multiple``: as :func:`probe_set` takes them."""
    probe = probe_rows(rollouts, count)
    held_out = probe_rows(rollouts, count, offset=0.5)
    held_out = held_out[~torch.isin(held_out, probe)]
    options = {"pack": pack, "max_tokens": max_tokens, "multiple": multiple}
    return (probe_set(rollouts, probe, micro_batch_size, vocab_size, **options),
            probe_set(rollouts, held_out, micro_batch_size, vocab_size, **options) if len(held_out) else None)
