"""Rollouts: batched sampling from the current policy with Megatron's KV cache.

:func:`generate` turns ``prompts`` (lists of token ids) into :class:`Rollouts`, ``G`` sampled
completions per prompt, on any tensor/pipeline-parallel layout. The design choices:

**KV cache.** Megatron's own ``StaticInferenceContext`` is passed to ``GPTModel.forward``: each
attention layer keeps its keys/values in the context, and the context's ``sequence_len_offset``
says where the next tokens go. One prefill forward over the prompts fills it; after that
every step feeds one token per row, so a new token costs one token of compute. With
``materialize_only_last_token_logits`` (the static context's default) only the last column's
logits are computed. The loop stops as soon as every row has emitted EOS.

**Padding: left.** Static batching writes every row's token ``t`` into the same cache slot, so
the prompts are right-aligned (left-padded to the longest prompt ``P``) and all completions start
at column ``P``. Two things make a padded row compute exactly what the prompt alone would:

* masks: pad keys are masked out for every query (prefill: causal OR pad key; decode: pad key),
  through the boolean ``attention_mask`` (True = masked) that the local spec's core attention
  (Megatron's ``DotProductAttention``, or ``SDPAttention``, models/sdpa_attention.py) applies on
  top of its own handling. Transformer Engine's attention
  ignores that mask for causal/no-mask layers, so batches with unequal prompt lengths are refused
  with a clear error when a model is not built with the local layer spec.
* positions: Megatron's rotary embedding is indexed by cache slot, the same for every row, which
  would shift a padded prompt's positions by its padding. RoPE only sees position differences, so
  that shift changes nothing mathematically, but it does change rounding. When a batch has
  padding, :func:`rope_positions` swaps in per-row rotary frequencies for the duration of the
  call, so row ``b`` sees positions ``0, 1, ...`` from its first real token, as the prompt alone
  would. ``Rollouts.position_ids`` records them; the trainer may recompute log-probs under the
  same context manager (see its docstring).

**Prefill: packed** (:func:`prefill_packed`, the default where :func:`packs_prefill` allows it:
SDPA attention). The cache is left-padded, the prefill's compute is not: each distinct prompt
goes through the model once (not once per sample), the prompts end to end as one ``[1, t]``
sequence with ``cu_seqlens`` (``t`` = their real tokens; rotary positions restart and attention
stops at every boundary), with a one-row staging context into which Megatron writes each packed
token's key and value as its cache holds them (before the rotary embedding). They are then moved
into the batch's cache, each prompt's tokens into the left-padded slots of each of its ``G``
rows; padding slots stay zero and masked, and only the prompts' last tokens reach the output
layer. Decoding then runs on that cache exactly as after a padded prefill. ``pack=False``
(``--no-pack-sequences``), Megatron's unfused attention, sequence parallelism or flash decoding
prefill the padded ``[B, P]`` block in one forward instead (:func:`prefill_padded`), under the
masks and positions above; both give the same logits and cache within 1e-5 in fp32 and the same
tokens (tests/test_packed_prefill.py; TP2 and PP2: tests/workers/rollout_checks.py).

**Layout: one [B, P + max_new_tokens] tensor.** Columns ``< P`` are the left-padded prompt,
columns ``>= P`` the completion, which ends with EOS (included) and is then right-padded with
``pad_id``. Rows are prompt-major: rows ``i*G .. i*G+G-1`` are the ``G`` samples of prompt ``i``.

**How ranks agree on tokens.** Megatron gathers the vocab-parallel logits over the TP group
in inference mode (``runtime_gather_output=True``), so the last pipeline stage holds the full
distribution. Only TP rank 0 of the last stage samples, with its own ``torch.Generator`` seeded
from ``SamplingConfig.seed``; the tokens are broadcast over the TP group, then from the last
stage over the pipeline group so the first stage can embed them next step. Sampling on one rank
and broadcasting guarantees agreement even where identical inputs might round differently, and
makes the stream of random numbers independent of the TP/PP layout. Every rank then holds the
same tokens and takes the same stop decision without further communication.

**Pipeline.** One microbatch per step, stage by stage: a non-first stage receives the previous
stage's hidden states with Megatron's inference p2p helpers and hands them to the model through
``set_input_tensor``; a non-last stage sends its output on. There is nothing to overlap within
one decode step, so no schedule is involved. Under a virtual pipeline (``model`` the list of a
rank's chunks) a forward runs the rank's chunks one after another, each a stage of the ring
rank 0 -> .. -> rank PP-1 -> rank 0 -> ..: chunk ``v`` of the last rank sends to chunk ``v + 1``
of the first, so the model's layers run in their order and the KV cache (keyed by the global
layer number) holds every chunk's layers.

**Data parallel.** Replicas generate independently: each passes its own prompts and no collective
spans replicas. All ranks of one replica must pass the same prompts and config. The seed is used
as given; offset it by the data-parallel rank when replicas should draw different streams.
"""

import contextlib
import time
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import set_model_to_sequence_parallel
from megatron.core.utils import get_attr_wrapped_model

from logra_megatron import parallel
from logra_megatron.engine_memory import SAMPLES_WITH_TRAINER_WEIGHTS
from logra_megatron.errors import UserError
from logra_megatron.models.build import model_device, unwrap_model
from logra_megatron.models.positions import pack_rows, padded_causal_mask, rope_positions
from logra_megatron.models.sdpa_attention import SDPAttention
from logra_megatron.rollout.sampling import sample_next
from logra_megatron.rollout.types import PromptLayout, Rollouts, SamplingConfig
from logra_megatron.training.lm import model_chunks


def _honors_padding_mask(model) -> bool:
    """True when every attention layer of this stage applies an explicit boolean mask in both
    prefill and decode (Megatron's local ``DotProductAttention`` and ``SDPAttention`` do; TE's
    does not)."""
    layers = [m for chunk in model_chunks(model) for name, m in unwrap_model(chunk).named_modules()
              if name.endswith("core_attention")]
    return all(isinstance(layer, (DotProductAttention, SDPAttention)) for layer in layers)


def _stage_forward(model, tokens, position_ids, attention_mask, context=None, packed_seq_params=None):
    """One forward of this rank's pipeline stage over ``tokens`` ([B, s]; packed: [1, t] with
    ``packed_seq_params``).

    Receives the previous stage's hidden states (non-first stages), sends this stage's output on
    (non-last stages) and returns the full-vocabulary logits [B, s', V] on the last stage (s' = 1
    with a static inference context, which materializes only the last column), None elsewhere.
    Several chunks (a virtual pipeline) run in order, each receiving from and sending to the
    neighbouring pipeline ranks of the ring (the module docstring).
    """
    output = None
    for chunk in model_chunks(model):
        gpt = unwrap_model(chunk)
        if not gpt.pre_process:
            config = gpt.config
            buffer = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size,
                                 dtype=config.pipeline_dtype or config.params_dtype, device=tokens.device)
            recv_from_prev_pipeline_rank_(buffer, parallel.pp_group())
            get_attr_wrapped_model(chunk, "set_input_tensor")(buffer)
        output = chunk(tokens, position_ids, attention_mask, inference_context=context,
                       runtime_gather_output=True, packed_seq_params=packed_seq_params)
        if not gpt.post_process:
            send_to_next_pipeline_rank(output.contiguous(), parallel.pp_group())
            output = None
    if context is not None:  # once per token column, whatever the chunks
        context.increment_sequence_len_offset(tokens.shape[1])
    return output


def _agree_on_tokens(tokens: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """The tokens sampled on TP rank 0 of the last stage, on every rank of the replica."""
    if tokens is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=device)
    if parallel.is_last_stage() and parallel.tp_size() > 1:
        dist.broadcast(tokens, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel.tp_group())
    return parallel.broadcast_from_last_stage(tokens)


def _check_prompts(prompts: Sequence[Sequence[int]], config: SamplingConfig, model_vocab: int,
                   max_sequence_length: int) -> None:
    if config.vocab_size is not None:
        model_vocab = min(model_vocab, config.vocab_size)
    if len(prompts) == 0:
        raise UserError("generate() needs at least one prompt")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise UserError(f"prompt {index} is empty; every prompt needs at least one token")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= model_vocab:
            raise UserError(f"prompt {index} has token id {low if low < 0 else high} outside the "
                            f"model's vocabulary [0, {model_vocab})")
    longest = max(len(p) for p in prompts)
    if longest + config.max_new_tokens > max_sequence_length:
        raise UserError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's max sequence length {max_sequence_length}; shorten prompts or max_new_tokens"
        )
    if config.pad_id >= model_vocab:
        raise UserError(f"pad_id {config.pad_id} is outside the model's vocabulary [0, {model_vocab})")


def packs_prefill(model) -> bool:
    """True when this stage can prefill packed: every attention layer is :class:`SDPAttention`
    (Megatron's local ``DotProductAttention`` takes no packed sequences), and neither sequence
    parallelism (the output layer's input would be a sequence shard) nor flash decoding (it
    caches rotated keys) is on."""
    chunks = [unwrap_model(chunk) for chunk in model_chunks(model)]
    layers = [m for gpt in chunks for name, m in gpt.named_modules() if name.endswith("core_attention")]
    config = chunks[0].config
    return (bool(layers) and all(isinstance(layer, SDPAttention) for layer in layers)
            and not config.sequence_parallel and not config.flash_decode)


@contextlib.contextmanager
def without_sequence_parallel(model):
    """Within the block, ``model`` (a trainer's model built with ``--sequence-parallel``) runs
    without sequence parallelism: a decode step feeds one token per row, which cannot be split
    over the TP ranks, and the padded prefill's width need not divide by TP. The two compute the
    same function (SP only moves where the activations outside the linears live); Megatron's own
    ``set_model_to_sequence_parallel`` switches the model's config and its layers' flags."""
    chunks = [unwrap_model(chunk) for chunk in model_chunks(model)]
    if not chunks[0].config.sequence_parallel:
        yield
        return
    for gpt in chunks:
        set_model_to_sequence_parallel(gpt, False)
    try:
        yield
    finally:
        for gpt in chunks:
            set_model_to_sequence_parallel(gpt, True)


@contextlib.contextmanager
def _output_rows(model, index: torch.Tensor):
    """Within the block, this stage's output layer (last stage only) computes the logits of the
    packed positions ``index`` alone: ``[len(index), V]`` instead of one row per packed token."""
    gpt = unwrap_model(model_chunks(model)[-1])  # (the output layer is in the last chunk)
    layer = getattr(gpt, "output_layer", None) if gpt.post_process else None
    if layer is None:
        yield
        return
    # hidden states are [t, 1, h] (sequence first): keep the rows of `index`
    handle = layer.register_forward_pre_hook(lambda module, args: (args[0].index_select(0, index), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def prefill_packed(model, layout: PromptLayout, samples_per_prompt: int,
                   context: StaticInferenceContext) -> Optional[torch.Tensor]:
    """Fill ``context``'s KV cache with the prompts of ``layout`` without padding; the logits of
    every row's last prompt token ``[B, 1, V]`` on the last stage (None elsewhere).

    Each distinct prompt (the first of its ``G`` rows) goes through the model once, all of them
    end to end as one ``[1, t]`` sequence (``pack_rows``: ``cu_seqlens`` at the prompt
    boundaries, positions from 0 in each, attention within each), so ``t`` is the prompts' real
    token count, not ``B x P``. The forward runs with a staging static context of one row and
    ``t`` slots: Megatron writes packed token ``i``'s key and value (as its cache holds them,
    before the rotary embedding) into slot ``i``. They are then moved to the batch's cache,
    each prompt's tokens into the left-padded slots of each of its ``G`` rows, the padding slots
    left at zero (the decode mask hides them). Only the prompts' last tokens reach the output
    layer."""
    batch, width = layout.tokens.shape[0], layout.width
    device = layout.tokens.device
    first = torch.arange(0, batch, samples_per_prompt, device=device)  # one row per prompt
    packed = pack_rows(layout.tokens[first, :width], layout.real[first, :width])
    length = packed.tokens.shape[1]
    staging = StaticInferenceContext(max_batch_size=1, max_sequence_length=length)
    staging.materialize_only_last_token_logits = False  # the output-layer hook picks the rows
    last = packed.params.cu_seqlens_q[1:].long() - 1  # each prompt's last packed token
    with _output_rows(model, last):
        logits = _stage_forward(model, packed.tokens, packed.position_ids, None, staging, packed.params)
    # packed token i of prompt p, at column slots[i] of its padded row: rows p*G .. p*G+G-1
    rows = packed.rows[:, None] * samples_per_prompt + torch.arange(samples_per_prompt, device=device)
    slots = packed.slots[:, None].expand_as(rows)
    for layer, staged in staging.key_value_memory_dict.items():
        cache = []
        for tensor in staged:  # [t, 1, groups, head_dim]
            memory = tensor.new_zeros((context.max_sequence_length, context.max_batch_size, *tensor.shape[2:]))
            memory[slots, rows] = tensor[:length, 0, None].expand(-1, samples_per_prompt, *tensor.shape[2:])
            cache.append(memory)
        context.key_value_memory_dict[layer] = tuple(cache)
    context.increment_sequence_len_offset(width)
    if logits is None:
        return None
    return logits[0, layout.prompt_index][:, None]  # [B, 1, V]: each row its prompt's logits


def prefill_padded(model, layout: PromptLayout, context: StaticInferenceContext) -> Optional[torch.Tensor]:
    """Fill ``context``'s KV cache with the left-padded ``[B, P]`` prompt block (pad keys
    masked); the last column's logits ``[B, 1, V]`` on the last stage (None elsewhere). Call
    within :func:`rope_positions` of the layout when it has padding."""
    width = layout.width
    mask = padded_causal_mask(layout.real[:, :width])
    return _stage_forward(model, layout.tokens[:, :width], layout.positions[:, :width], mask, context)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], config: SamplingConfig, pack: bool = True) -> Rollouts:
    """Sample ``config.samples_per_prompt`` completions of every prompt with the KV cache.

    ``model`` is this rank's stage of the policy (``build_gpt_model``, optionally wrapped in
    Megatron DDP / Float16Module); it is put in eval mode for the call and restored afterwards.
    Collective over the tensor- and pipeline-parallel groups: every rank of a model replica calls
    it with the same prompts and config. Returns the same :class:`Rollouts` on all those ranks.
    ``pack``: prefill the prompts packed (:func:`prefill_packed`) where the model allows it
    (:func:`packs_prefill`); False, or a model that does not, prefills the padded block. A model
    built with sequence parallelism samples without it (:func:`without_sequence_parallel`).
    """
    with without_sequence_parallel(model):
        return _generate(model, prompts, config, pack)


@contextlib.contextmanager
def _rope_positions(model, positions: torch.Tensor):
    """:func:`rope_positions` on every chunk (each applies its own rotary embedding)."""
    with contextlib.ExitStack() as stack:
        for chunk in model_chunks(model):
            stack.enter_context(rope_positions(chunk, positions))
        yield


def _generate(model, prompts: Sequence[Sequence[int]], config: SamplingConfig, pack: bool) -> Rollouts:
    chunks = model_chunks(model)
    gpt = unwrap_model(chunks[0])
    device = model_device(gpt)
    _check_prompts(prompts, config, gpt.vocab_size, gpt.max_sequence_length)
    layout = PromptLayout.of(prompts, config.samples_per_prompt, config.max_new_tokens, config.pad_id, device)
    tokens, width = layout.tokens, layout.width
    batch, total = tokens.shape
    padded = bool((layout.lengths != width).any())
    if padded and not _honors_padding_mask(model):
        raise UserError(
            "prompts of different lengths need Megatron's local attention (it applies the padding "
            "mask); this model uses another attention implementation. Build it with "
            "gpt_layer_spec(use_transformer_engine=False), or pass prompts of equal length"
        )
    packed = pack and packs_prefill(model)
    # Left padding: row b's prompt ends at column `width`; its completion follows.
    real = layout.real  # [B, total]; completion columns count as real
    positions = layout.positions

    sampler = parallel.is_last_stage() and parallel.tp_rank() == 0
    generator = None
    if sampler and not config.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
    vocab = config.vocab_size if config.vocab_size is not None else gpt.vocab_size

    context = StaticInferenceContext(max_batch_size=batch, max_sequence_length=total)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    response_lengths = torch.zeros(batch, dtype=torch.int64, device=device)
    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    steps = 0
    try:
        if packed:  # positions restart at each prompt: no per-row rotary needed for the prefill
            logits = prefill_packed(model, layout, config.samples_per_prompt, context)
        # Without padding every row's positions are the slot indices Megatron uses anyway.
        with _rope_positions(model, positions) if padded else contextlib.nullcontext():
            if not packed:
                logits = prefill_padded(model, layout, context)
            context.enable_decode_mode()
            for step in range(config.max_new_tokens):
                column = width + step
                sampled = None
                if sampler:
                    sampled = sample_next(logits[:, -1, :vocab], config.temperature, config.top_k,
                                          config.top_p, generator)
                sampled = _agree_on_tokens(sampled, batch, device)
                sampled = torch.where(done, torch.full_like(sampled, config.pad_id), sampled)
                tokens[:, column] = sampled
                response_lengths += (~done).long()
                if config.eos_id is not None:
                    done |= sampled == config.eos_id
                steps = step + 1
                if step == config.max_new_tokens - 1 or bool(done.all()):
                    break
                decode_mask = ~real[:, None, None, :column + 1]
                logits = _stage_forward(model, tokens[:, column:column + 1],
                                        positions[:, column:column + 1], decode_mask, context)
    finally:
        for chunk in chunks:
            chunk.train(was_training)
            if not unwrap_model(chunk).pre_process:
                get_attr_wrapped_model(chunk, "set_input_tensor")(None)

    return layout.rollouts(response_lengths, done, steps)


class MegatronEngine:
    """The embedded engine (``--rollout-engine megatron``): :func:`generate` on the trainer's own
    model, at any TP/PP layout. It reads the live weights, so a sync moves nothing."""

    name = "megatron"
    memory = SAMPLES_WITH_TRAINER_WEIGHTS  # (engine_memory.py) its KV cache only

    def __init__(self, model, pack_sequences: bool = True):
        self.model = model
        self.pack_sequences = pack_sequences  # prefill packed (see generate); --no-pack-sequences: padded

    def generate(self, prompts, sampling: SamplingConfig) -> Rollouts:
        return generate(self.model, prompts, sampling, pack=self.pack_sequences)

    def sync_weights(self, model) -> Dict[str, float]:
        start = time.perf_counter()
        self.model = model
        return {"sync_bytes": 0.0, "sync_time_s": time.perf_counter() - start}
