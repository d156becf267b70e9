"""Forward passes through Megatron's pipeline schedule, at any TP/PP layout.

- :func:`lm_forward_backward`: the next-token language-modeling loss over a global batch split
  into microbatches, forward and backward, agreed on every rank (the smoke job, tests and the
  supervised warm-up).
- :func:`stream_logits`: vocab-parallel logits, forward only, of several batches through one
  schedule call, handed out one batch at a time (the KL controller's probes);
  :func:`forward_logits` collects them.
- :func:`padded_forward`: one model call on a left-padded batch (rollouts), shared with the
  GRPO passes; :func:`packed_forward` the same rows packed without padding.
- :func:`pipeline_pass`: Megatron's schedule over a list of microbatches, with one model chunk
  or several (the interleaved schedule of a virtual pipeline); every pass above goes through it.

``model`` is this rank's model, or under a virtual pipeline (``--num-layers-per-virtual-pipeline-stage``)
the list of its chunks; the functions called with one chunk at a time (``padded_forward``,
``packed_forward``) ask that chunk whether it ends the model (``post_process``).
"""

import contextlib

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from logra_megatron import parallel
from logra_megatron.layout import microbatch_group_size
from logra_megatron.models.build import causal_attention_mask, model_device, position_ids_for, unwrap_model
from logra_megatron.models.positions import PackedRows, padded_causal_mask, rope_positions
from logra_megatron.ops.vocab_parallel import mask_padded_vocab


def model_chunks(model) -> list:
    """This rank's model chunks: ``model`` itself in a list, or the list of chunks a virtual
    pipeline builds (one per virtual stage, in order)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def ends_model(model) -> bool:
    """True when ``model`` (one chunk, wrapped or not) computes the logits: the last stage's
    only chunk, or its last chunk under a virtual pipeline."""
    return bool(unwrap_model(model).post_process)


@contextlib.contextmanager
def _group_size(chunks: list, num_microbatches: int):
    config = get_model_config(chunks[0])  # (one TransformerConfig serves every chunk)
    saved = config.microbatch_group_size_per_vp_stage
    config.microbatch_group_size_per_vp_stage = microbatch_group_size(num_microbatches, parallel.pp_size())
    try:
        yield
    finally:
        config.microbatch_group_size_per_vp_stage = saved


def _filler_loss(output):
    # zero loss (and so exactly zero gradients and sketches) for a microbatch that only fills the pipeline
    return output.float().sum() * 0, {}


def pipeline_pass(model, forward_step, batches: list, seq_length: int, micro_batch_size: int,
                  forward_only: bool) -> list:
    """Megatron's forward(-backward) schedule over ``batches``, one microbatch each; returns the
    loss functions' reports in microbatch order on the last stage (``[]`` elsewhere).

    ``forward_step(batch, chunk, num_microbatches)`` returns ``(output, loss_func)`` as Megatron's
    forward step does (``num_microbatches``: what the schedule divides the loss by). With several
    chunks it is Megatron's interleaved schedule: one data iterator per chunk over the same
    microbatches. That schedule needs at least PP microbatches; a pass with fewer (a KL probe
    part, a small minibatch) is filled up with copies of its last microbatch whose loss is zero
    times the output (no gradient, no sketch) and whose reports are dropped."""
    chunks = model_chunks(model)
    items = [(batch, False) for batch in batches]
    if len(chunks) > 1 and len(items) < parallel.pp_size():
        items += [(batches[-1], True)] * (parallel.pp_size() - len(items))
    total = len(items)

    def step(data_iterator, chunk):
        batch, filler = next(data_iterator)
        output, loss_func = forward_step(batch, chunk, total)
        return output, _filler_loss if filler else loss_func

    with _group_size(chunks, total) if len(chunks) > 1 else contextlib.nullcontext():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            # the interleaved schedule reads each chunk's microbatches from that chunk's iterator
            data_iterator=iter(items) if len(chunks) == 1 else [iter(items) for _ in chunks],
            model=chunks, num_microbatches=total, seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=forward_only)
    return list(outputs)[:len(batches)] if parallel.is_last_stage() else []


def _lm_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean over unmasked tokens of one microbatch (Megatron's 2-tuple loss contract: the
    schedule divides by the number of microbatches)."""
    mask = loss_mask.float()
    loss = (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def lm_forward_backward(model, tokens: torch.Tensor, micro_batch_size: int,
                        forward_only: bool = False, loss_mask: torch.Tensor = None,
                        vocab_size: int = None, keep_logits=None) -> float:
    """Mean LM loss of ``tokens`` ([batch, seq], the same on every rank of a DP replica).

    Inputs are ``tokens[:, :-1]``, labels ``tokens[:, 1:]``. With ``vocab_size``, Megatron's
    vocabulary padding is excluded from the softmax, so the loss does not depend on the TP size. With ``forward_only=False`` the
    gradients (mean over microbatches) are accumulated into the model. Returns the loss on every
    rank (computed on the last stage, broadcast over the pipeline, averaged over DP).
    ``keep_logits`` (the KL controller's ``StepLogits``) is shown each microbatch's rows and
    logits (of ``tokens[:, :-1]``) on the last stage; the loss is then taken outside the model.
    """
    batch, length = tokens.shape
    if batch % micro_batch_size != 0:
        raise ValueError(f"batch {batch} is not a multiple of micro batch size {micro_batch_size}")
    device = model_device(model_chunks(model)[0])
    tokens = tokens.to(device)
    loss_mask = None if loss_mask is None else loss_mask.to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float)
    else:
        loss_mask = loss_mask[:, 1:].float()
    mask = causal_attention_mask(length - 1, device=device)
    microbatches = [
        (inputs[i : i + micro_batch_size], labels[i : i + micro_batch_size],
         loss_mask[i : i + micro_batch_size], i)
        for i in range(0, batch, micro_batch_size)
    ]

    def forward_step(microbatch, model, _):
        mb_inputs, mb_labels, mb_mask, first = microbatch
        if vocab_size is None and keep_logits is None:
            output = model(mb_inputs, position_ids_for(mb_inputs), mask, labels=mb_labels)
            return output, lambda out: _lm_loss(mb_mask, out)
        logits = model(mb_inputs, position_ids_for(mb_inputs), mask)
        if not ends_model(model):  # not the model's last chunk: hidden states
            return logits, lambda out: _lm_loss(mb_mask, out)  # only the last stage calls it
        logits = mask_padded_vocab(logits, vocab_size)
        if keep_logits is not None:
            keep_logits(torch.arange(first, first + len(mb_inputs), device=device), logits)
        per_token = vocab_parallel_cross_entropy(logits.float(), mb_labels)
        return per_token, lambda out: _lm_loss(mb_mask, out)

    losses = pipeline_pass(model, forward_step, microbatches, seq_length=length - 1,
                           micro_batch_size=micro_batch_size, forward_only=forward_only)
    mean = 0.0
    if parallel.is_last_stage():
        mean = float(sum(item["lm loss"] for item in losses) / len(losses))
    return parallel.agree_on_scalar(mean)


def padded_forward(model, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   vocab_size: int = None) -> torch.Tensor:
    """This stage's output for a left-padded batch: every row attends only to its own real
    tokens (``attention_mask`` [B, S] bool, True at real tokens) at its own rotary positions
    (``position_ids``, 0 at the first real token), so it computes what its sequence alone
    would. On the last stage: vocab-parallel logits, the vocabulary padding masked when
    ``vocab_size`` is given."""
    device = model_device(model)
    tokens, attention_mask, position_ids = tokens.to(device), attention_mask.to(device), position_ids.to(device)
    with rope_positions(model, position_ids):
        output = model(tokens, position_ids, padded_causal_mask(attention_mask))
    return mask_padded_vocab(output, vocab_size) if ends_model(model) else output


def packed_forward(model, packed: PackedRows, vocab_size: int = None) -> torch.Tensor:
    """This stage's output for packed rows (:func:`~logra_megatron.models.positions.pack_rows`):
    ``[1, t, V/tp]`` vocab-parallel logits on the last stage (the vocabulary padding masked when
    ``vocab_size`` is given), each row computing what it alone would (rotary positions restart
    and attention stops at each ``cu_seqlens`` boundary)."""
    output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.params)
    return mask_padded_vocab(output, vocab_size) if ends_model(model) else output


def _batch_shape(batch) -> tuple:
    """What the pipeline's point-to-point sends of ``batch`` depend on: (rows, sequence length)."""
    if isinstance(batch, PackedRows):
        return 1, batch.tokens.shape[1]
    tokens = batch[0] if isinstance(batch, tuple) else batch
    return tokens.shape[0], tokens.shape[1]


@torch.no_grad()
def stream_logits(model, batches: list, consume, vocab_size: int = None) -> None:
    """Vocab-parallel logits of every batch of ``batches``, forward only, handed to
    ``consume(index, logits)`` on the last stage as each comes out of the model (so one batch's
    logits are alive at a time, not all of them).

    A batch is ``tokens`` (plain causal rows, ``[b, s]``), ``(tokens, attention_mask,
    position_ids)`` (left-padded rows: :func:`padded_forward`) or a :class:`PackedRows`
    (:func:`packed_forward`); logits ``[b, s, V/tp]`` or ``[1, t, V/tp]``, the vocabulary padding
    masked with ``vocab_size``. Consecutive batches of one shape go through ONE call of
    Megatron's schedule, so under a pipeline they fill it together instead of one drained pass
    each; a new shape starts a new call, since the stages' point-to-point buffers have one shape
    a call (``rl/grpo.py: probe_set`` pads packed parts to one length under PP for this). With
    PP = 1 nothing is sent between stages and every batch goes in one call."""
    device = model_device(model_chunks(model)[0])
    runs = []  # [(shape, [(index, batch)])]
    for index, batch in enumerate(batches):
        shape = _batch_shape(batch)
        if runs and (runs[-1][0] == shape or parallel.pp_size() == 1):
            runs[-1][1].append((index, batch))
        else:
            runs.append((shape, [(index, batch)]))
    causal_masks = {}  # sequence length -> its causal mask, built once for every plain batch of that length

    def forward_step(item, model, _):  # (model: one chunk)
        index, batch = item
        if isinstance(batch, PackedRows):
            output = packed_forward(model, batch.to(device), vocab_size)
        elif isinstance(batch, tuple):
            output = padded_forward(model, *batch, vocab_size)
        else:
            inputs = batch.to(device)
            length = inputs.shape[1]
            if length not in causal_masks:
                causal_masks[length] = causal_attention_mask(length, device=device)
            output = model(inputs, position_ids_for(inputs), causal_masks[length])
            output = mask_padded_vocab(output, vocab_size) if ends_model(model) else output

        def hand_over(logits):  # the last stage only; the schedule's loss is a zero it discards
            consume(index, logits.detach())
            return logits.new_zeros((), dtype=torch.float32), {}
        return output, hand_over

    for (rows, length), items in runs:
        pipeline_pass(model, forward_step, items, seq_length=length, micro_batch_size=rows, forward_only=True)


def forward_logits(model, tokens: torch.Tensor, micro_batch_size: int = None, attention_mask: torch.Tensor = None,
                   position_ids: torch.Tensor = None, vocab_size: int = None):
    """Vocab-parallel logits ``[batch, seq, V/tp]`` of ``tokens`` through the pipeline schedule
    (forward only) on the last stage; ``None`` on other stages.

    Plain causal rows by default; with ``attention_mask`` and ``position_ids`` (left-padded rows,
    as :class:`~logra_megatron.rollout.types.Rollouts` holds them) each row goes through
    :func:`padded_forward`. With ``vocab_size`` the vocabulary padding is masked.
    """
    batch = tokens.shape[0]
    micro_batch_size = min(micro_batch_size or batch, batch)
    tokens = tokens.to(model_device(model_chunks(model)[0]))
    parts = [slice(i, i + micro_batch_size) for i in range(0, batch, micro_batch_size)]
    batches = [tokens[part] if attention_mask is None else (tokens[part], attention_mask[part], position_ids[part])
               for part in parts]
    kept = {}
    stream_logits(model, batches, kept.__setitem__, vocab_size)
    if not parallel.is_last_stage():
        return None
    return torch.cat([kept[index] for index in range(len(batches))], dim=0)
