"""Forward passes through Megatron's pipeline schedule, at any TP/PP layout.

- :func:`lm_forward_backward`: the next-token language-modeling loss over a global batch split
  into microbatches, forward and backward, agreed on every rank (the smoke job, tests and the
  supervised warm-up).
- :func:`forward_logits`: vocab-parallel logits, forward only (the KL controller's probes, and
  the GRPO probe rows of left-padded rollouts).
- :func:`padded_forward`: one model call on a left-padded batch (rollouts), shared with the
  GRPO passes; :func:`packed_forward` the same rows packed without padding.
"""

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from logra_megatron import parallel
from logra_megatron.models.build import causal_attention_mask, model_device, position_ids_for, unwrap_model
from logra_megatron.models.positions import PackedRows, padded_causal_mask, rope_positions
from logra_megatron.ops.vocab_parallel import mask_padded_vocab


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
    chunks = model if isinstance(model, list) else [model]  # several under a virtual pipeline
    device = model_device(chunks[0])
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

    def forward_step(data_iterator, model):
        mb_inputs, mb_labels, mb_mask, first = next(data_iterator)
        if vocab_size is None and keep_logits is None:
            output = model(mb_inputs, position_ids_for(mb_inputs), mask, labels=mb_labels)
            return output, lambda out: _lm_loss(mb_mask, out)
        logits = model(mb_inputs, position_ids_for(mb_inputs), mask)
        if not unwrap_model(model).post_process:  # not the model's last chunk: hidden states
            return logits, lambda out: _lm_loss(mb_mask, out)  # only the last stage calls it
        logits = mask_padded_vocab(logits, vocab_size)
        if keep_logits is not None:
            keep_logits(torch.arange(first, first + len(mb_inputs), device=device), logits)
        per_token = vocab_parallel_cross_entropy(logits.float(), mb_labels)
        return per_token, lambda out: _lm_loss(mb_mask, out)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        # the interleaved schedule reads each chunk's microbatches from that chunk's iterator
        data_iterator=iter(microbatches) if len(chunks) == 1 else [iter(microbatches) for _ in chunks],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=length - 1,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
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
    return mask_padded_vocab(output, vocab_size) if parallel.is_last_stage() else output


def packed_forward(model, packed: PackedRows, vocab_size: int = None) -> torch.Tensor:
    """This stage's output for packed rows (:func:`~logra_megatron.models.positions.pack_rows`):
    ``[1, t, V/tp]`` vocab-parallel logits on the last stage (the vocabulary padding masked when
    ``vocab_size`` is given), each row computing what it alone would (rotary positions restart
    and attention stops at each ``cu_seqlens`` boundary)."""
    output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.params)
    return mask_padded_vocab(output, vocab_size) if parallel.is_last_stage() else output


@torch.no_grad()
def forward_packed_logits(model, packed: PackedRows, vocab_size: int = None):
    """Vocab-parallel logits ``[1, t, V/tp]`` of one packed sequence through the pipeline
    schedule (forward only) on the last stage; ``None`` on other stages."""

    packed = packed.to(model_device(model))

    def forward_step(data_iterator, model):
        output = packed_forward(model, next(data_iterator), vocab_size)
        return output, lambda out: (out.float().sum() * 0, {"logits": out.detach()})

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([packed]), model=[model], num_microbatches=1,
        seq_length=packed.tokens.shape[1], micro_batch_size=1, forward_only=True)
    return outputs[0]["logits"] if parallel.is_last_stage() else None


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, micro_batch_size: int = None, attention_mask: torch.Tensor = None,
                   position_ids: torch.Tensor = None, vocab_size: int = None):
    """Vocab-parallel logits ``[batch, seq, V/tp]`` of ``tokens`` through the pipeline schedule
    (forward only) on the last stage; ``None`` on other stages.

    Plain causal rows by default; with ``attention_mask`` and ``position_ids`` (left-padded rows,
    as :class:`~logra_megatron.rollout.types.Rollouts` holds them) each row goes through
    :func:`padded_forward`. With ``vocab_size`` the vocabulary padding is masked.
    """
    batch, length = tokens.shape
    micro_batch_size = min(micro_batch_size or batch, batch)
    tokens = tokens.to(model_device(model))
    causal = causal_attention_mask(length, device=tokens.device) if attention_mask is None else None
    parts = [slice(i, i + micro_batch_size) for i in range(0, batch, micro_batch_size)]

    def forward_step(data_iterator, model):
        part = next(data_iterator)
        if causal is not None:
            inputs = tokens[part]
            output = model(inputs, position_ids_for(inputs), causal)
            output = mask_padded_vocab(output, vocab_size) if parallel.is_last_stage() else output
        else:
            output = padded_forward(model, tokens[part], attention_mask[part], position_ids[part], vocab_size)
        return output, lambda out: (out.float().sum() * 0, {"logits": out.detach()})

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(parts), model=[model],
        num_microbatches=len(parts), seq_length=length, micro_batch_size=micro_batch_size,
        forward_only=True)
    if not parallel.is_last_stage():
        return None
    return torch.cat([item["logits"] for item in outputs], dim=0)
