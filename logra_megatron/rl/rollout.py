"""Rollouts: batched sampling from the current policy with Megatron's KV cache.

:func:`generate` turns ``prompts`` (lists of token ids) into :class:`Rollouts`, ``G`` sampled
completions per prompt, on any tensor/pipeline-parallel layout. The design choices:

**KV cache.** Megatron's own ``StaticInferenceContext`` is passed to ``GPTModel.forward``: each
attention layer keeps its keys/values in the context, and the context's ``sequence_len_offset``
says where the next tokens go. One prefill forward over all prompt columns fills it; after that
every step feeds one token per row, so a new token costs one token of compute. With
``materialize_only_last_token_logits`` (the static context's default) only the last column's
logits are computed. The loop stops as soon as every row has emitted EOS.

**Padding: left.** Static batching writes every row's token ``t`` into the same cache slot, so
the prompts are right-aligned (left-padded to the longest prompt ``P``) and all completions start
at column ``P``: one prefill covers all prompts and the last prefill column holds every row's
last prompt token. Two things make a padded row compute exactly what the prompt alone would:

* masks: pad keys are masked out for every query (prefill: causal OR pad key; decode: pad key),
  through the boolean ``attention_mask`` (True = masked) that Megatron's local
  ``DotProductAttention`` applies on top of its own handling. Transformer Engine's attention
  ignores that mask for causal/no-mask layers, so batches with unequal prompt lengths are refused
  with a clear error when a model is not built with the local layer spec.
* positions: Megatron's rotary embedding is indexed by cache slot, the same for every row, which
  would shift a padded prompt's positions by its padding. RoPE only sees position differences, so
  that shift changes nothing mathematically, but it does change rounding. When a batch has
  padding, :func:`rope_positions` swaps in per-row rotary frequencies for the duration of the
  call, so row ``b`` sees positions ``0, 1, ...`` from its first real token, as the prompt alone
  would. ``Rollouts.position_ids`` records them; the trainer may recompute log-probs under the
  same context manager (see its docstring).

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
one decode step, so no schedule is involved.

**Data parallel.** Replicas generate independently: each passes its own prompts and no collective
spans replicas. All ranks of one replica must pass the same prompts and config. The seed is used
as given; offset it by the data-parallel rank when replicas should draw different streams.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.errors import UserError
from logra_megatron.rl.sampling import sample_next


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. Validated on construction (:class:`UserError`)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax; top-k, top-p and seed are then unused)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most probable tokens up to this total probability, in (0, 1];
    1 keeps all."""
    top_k: int = 0
    """Keep only the k most probable tokens; 0 keeps all."""
    max_new_tokens: int = 128
    """Most tokens generated per sequence (EOS included)."""
    samples_per_prompt: int = 1
    """G: sampled completions per prompt; ``generate`` returns len(prompts) * G rows."""
    eos_id: Optional[int] = None
    """End-of-sequence token: a row stops after emitting it (it is part of the completion).
    None: rows only stop at ``max_new_tokens``."""
    pad_id: int = 0
    """Token written into padding positions (left of short prompts, right of finished
    completions); it is masked out wherever it appears, so any valid id works."""
    seed: int = 0
    """Seed of the sampling generator: the same seed, prompts and weights give the same tokens."""
    vocab_size: Optional[int] = None
    """Real vocabulary size. Megatron pads the output layer to a multiple of 128 x TP; logits at
    or beyond this index are never sampled. None: every output logit is a candidate."""

    def __post_init__(self):
        def integer(name, minimum):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(f"sampling {name} must be an integer, got {value!r}")
            if value < minimum:
                raise UserError(f"sampling {name} must be >= {minimum}, got {value}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"sampling temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise UserError(f"sampling top_p must be in (0, 1] (1 = no nucleus filter), got {self.top_p!r}")
        integer("top_k", 0)
        integer("max_new_tokens", 1)
        integer("samples_per_prompt", 1)
        integer("pad_id", 0)
        integer("seed", 0)
        if self.eos_id is not None:
            integer("eos_id", 0)
        if self.vocab_size is not None:
            integer("vocab_size", 1)
            for name in ("eos_id", "pad_id"):
                value = getattr(self, name)
                if value is not None and value >= self.vocab_size:
                    raise UserError(f"sampling {name} {value} is outside the vocabulary of size {self.vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollouts:
    """``len(prompts) * G`` sequences, as one left-padded batch (see the module docstring).

    Row ``b`` is sample ``b % G`` of prompt ``prompt_index[b] = b // G``. Every tensor is on the
    model's device and identical on every rank of the model replica.
    """

    tokens: torch.Tensor
    """[B, P + max_new_tokens] int64: left-padded prompt in columns < P, completion from column P,
    right-padded with ``pad_id`` after EOS / the last generated token."""
    attention_mask: torch.Tensor
    """[B, P + max_new_tokens] bool: True at real tokens (prompt and completion, EOS included)."""
    response_mask: torch.Tensor
    """[B, P + max_new_tokens] bool: True at completion tokens (EOS included)."""
    position_ids: torch.Tensor
    """[B, P + max_new_tokens] int64: each token's position within its own sequence (0 at the
    first real prompt token), as used for sampling; 0 at left padding."""
    prompt_lengths: torch.Tensor
    """[B] int64: real prompt tokens per row."""
    response_lengths: torch.Tensor
    """[B] int64: completion tokens per row (EOS included)."""
    finished: torch.Tensor
    """[B] bool: the completion ended with EOS (False: cut at max_new_tokens)."""
    prompt_index: torch.Tensor
    """[B] int64: which prompt each row samples."""
    prompt_width: int
    """P: the longest prompt; completions start at this column."""
    steps: int
    """Tokens generated per row before the loop ended (<= max_new_tokens)."""

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def completion_tokens(self) -> torch.Tensor:
        """[B, max_new_tokens]: the completion columns (EOS included, then ``pad_id``)."""
        return self.tokens[:, self.prompt_width:]

    @property
    def completion_mask(self) -> torch.Tensor:
        """[B, max_new_tokens] bool: ``response_mask`` over the completion columns."""
        return self.response_mask[:, self.prompt_width:]

    def prompt(self, row: int) -> List[int]:
        """Row ``row``'s prompt tokens, without padding."""
        return self.tokens[row, self.prompt_width - int(self.prompt_lengths[row]):self.prompt_width].tolist()

    def completion(self, row: int) -> List[int]:
        """Row ``row``'s completion tokens (EOS included), without padding."""
        return self.tokens[row, self.prompt_width:self.prompt_width + int(self.response_lengths[row])].tolist()

    def completions(self) -> List[List[int]]:
        return [self.completion(row) for row in range(self.num_sequences)]


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask ([B, 1, S, S], True = masked) for a left-padded batch: causal, and
    no query attends to a padding key. ``attention_mask`` is [B, S] bool, True at real tokens."""
    seq = attention_mask.shape[1]
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device), 1)
    return future[None, None] | ~attention_mask[:, None, None, :]


def _unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "decoder", return_model_obj=True)


class _RowRotary(torch.nn.Module):
    """Stands in for ``GPTModel.rotary_pos_emb``: the same frequencies, looked up per row.

    Megatron asks its rotary module for ``[S, 1, 1, dim]`` frequencies of slots ``0..S-1`` and
    attention slices them by cache slot; returning ``[S, B, 1, dim]`` with row ``b``'s slot ``t``
    at position ``position_ids[b, t]`` broadcasts the same way over the batch dimension.
    """

    def __init__(self, inner, position_ids: torch.Tensor):
        super().__init__()
        self.__dict__["_inner"] = inner  # not a registered submodule: nothing changes in state
        self._positions = position_ids.t()  # [S, B]
        self._cache = {}

    def get_rotary_seq_len(self, *args, **kwargs):
        return self._inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq or offset:
            raise NotImplementedError("per-row rotary positions do not support packed sequences or offsets")
        if max_seq_len > self._positions.shape[0]:
            raise ValueError(f"rope_positions covers {self._positions.shape[0]} slots, model asked for {max_seq_len}")
        if max_seq_len not in self._cache:
            slots = self._positions[:max_seq_len]
            table = self._inner(int(slots.max()) + 1)[:, 0, 0, :]  # [positions, dim]
            self._cache[max_seq_len] = table[slots].unsqueeze(2)  # [S, B, 1, dim]
        return self._cache[max_seq_len]


@contextlib.contextmanager
def rope_positions(model, position_ids: torch.Tensor):
    """Within the block, ``model`` (this rank's stage, wrapped or not) applies rotary embeddings
    at ``position_ids`` ([B, S]: row, slot -> position) instead of at the slot index.

    Forwards inside the block must use this batch (``B`` rows) and at most ``S`` slots; to
    recompute log-probs of :class:`Rollouts` in microbatches, wrap each model call with the
    microbatch's rows of ``Rollouts.position_ids`` (and pass ``padded_causal_mask`` of its
    ``attention_mask``). A no-op for models without rotary embeddings (their ``position_ids``
    argument already does this).
    """
    gpt = _unwrap(model)
    if getattr(gpt, "position_embedding_type", None) != "rope" or getattr(gpt, "rotary_pos_emb", None) is None:
        yield
        return
    if gpt.config.apply_rope_fusion or gpt.config.multi_latent_attention or gpt.config.flash_decode:
        raise NotImplementedError("per-row rotary positions need the unfused rotary path "
                                  "(apply_rope_fusion, flash_decode and MLA off)")
    original = gpt.rotary_pos_emb
    gpt.rotary_pos_emb = _RowRotary(original, position_ids)
    try:
        yield
    finally:
        gpt.rotary_pos_emb = original


def _honors_padding_mask(model) -> bool:
    """True when every attention layer of this stage applies an explicit boolean mask in both
    prefill and decode (Megatron's local ``DotProductAttention`` does; TE's does not)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layers = [m for name, m in _unwrap(model).named_modules() if name.endswith("core_attention")]
    return all(isinstance(layer, DotProductAttention) for layer in layers)


def _stage_forward(model, tokens, position_ids, attention_mask, context=None):
    """One forward of this rank's pipeline stage over ``tokens`` ([B, s]).

    Receives the previous stage's hidden states (non-first stages), sends this stage's output on
    (non-last stages) and returns the full-vocabulary logits [B, s', V] on the last stage (s' = 1
    with a static inference context, which materializes only the last column), None elsewhere.
    """
    from megatron.core.inference.communication_utils import (
        recv_from_prev_pipeline_rank_,
        send_to_next_pipeline_rank,
    )
    from megatron.core.utils import get_attr_wrapped_model

    if not parallel.is_first_stage():
        config = _unwrap(model).config
        buffer = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size,
                             dtype=config.pipeline_dtype or config.params_dtype, device=tokens.device)
        recv_from_prev_pipeline_rank_(buffer, parallel.pp_group())
        get_attr_wrapped_model(model, "set_input_tensor")(buffer)
    output = model(tokens, position_ids, attention_mask, inference_context=context,
                   runtime_gather_output=True)
    if context is not None:
        context.increment_sequence_len_offset(tokens.shape[1])
    if not parallel.is_last_stage():
        send_to_next_pipeline_rank(output.contiguous(), parallel.pp_group())
        return None
    return output


def _agree_on_tokens(tokens: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """The tokens sampled on TP rank 0 of the last stage, on every rank of the replica."""
    from megatron.core import parallel_state

    if tokens is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=device)
    if parallel.is_last_stage() and parallel.tp_size() > 1:
        dist.broadcast(tokens, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel.tp_group())
    if parallel.pp_size() > 1:
        dist.broadcast(tokens, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
    return tokens


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


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], config: SamplingConfig) -> Rollouts:
    """Sample ``config.samples_per_prompt`` completions of every prompt with the KV cache.

    ``model`` is this rank's stage of the policy (``build_gpt_model``, optionally wrapped in
    Megatron DDP / Float16Module); it is put in eval mode for the call and restored afterwards.
    Collective over the tensor- and pipeline-parallel groups: every rank of a model replica calls
    it with the same prompts and config. Returns the same :class:`Rollouts` on all those ranks.
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    gpt = _unwrap(model)
    device = next(gpt.parameters()).device
    _check_prompts(prompts, config, gpt.vocab_size, gpt.max_sequence_length)
    group = config.samples_per_prompt
    rows = [list(prompt) for prompt in prompts for _ in range(group)]
    batch, new = len(rows), config.max_new_tokens
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64, device=device)
    width = int(lengths.max())
    total = width + new
    padded = bool((lengths != width).any())
    if padded and not _honors_padding_mask(model):
        raise UserError(
            "prompts of different lengths need Megatron's local attention (it applies the padding "
            "mask); this model uses another attention implementation. Build it with "
            "gpt_layer_spec(use_transformer_engine=False), or pass prompts of equal length"
        )

    # Left padding: row b's prompt ends at column `width`; its completion follows.
    tokens = torch.full((batch, total), config.pad_id, dtype=torch.int64, device=device)
    for b, row in enumerate(rows):
        tokens[b, width - len(row):width] = torch.tensor(row, dtype=torch.int64, device=device)
    columns = torch.arange(total, device=device)
    start = (width - lengths)[:, None]  # first real column of each row
    real = columns[None, :] >= start  # [B, total]; completion columns count as real
    positions = (columns[None, :] - start).clamp(min=0)

    sampler = parallel.is_last_stage() and parallel.tp_rank() == 0
    generator = None
    if sampler and not config.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
    vocab = config.vocab_size if config.vocab_size is not None else gpt.vocab_size

    context = StaticInferenceContext(max_batch_size=batch, max_sequence_length=total)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    response_lengths = torch.zeros(batch, dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    steps = 0
    try:
        # Without padding every row's positions are the slot indices Megatron uses anyway.
        with rope_positions(model, positions) if padded else contextlib.nullcontext():
            prefill_mask = padded_causal_mask(real[:, :width])
            logits = _stage_forward(model, tokens[:, :width], positions[:, :width], prefill_mask, context)
            context.enable_decode_mode()
            for step in range(new):
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
                if step == new - 1 or bool(done.all()):
                    break
                decode_mask = ~real[:, None, None, :column + 1]
                logits = _stage_forward(model, tokens[:, column:column + 1],
                                        positions[:, column:column + 1], decode_mask, context)
    finally:
        model.train(was_training)
        if not parallel.is_first_stage():
            from megatron.core.utils import get_attr_wrapped_model

            get_attr_wrapped_model(model, "set_input_tensor")(None)

    response = (columns[None, :] >= width) & (columns[None, :] < width + response_lengths[:, None])
    return Rollouts(
        tokens=tokens,
        attention_mask=(real & (columns[None, :] < width)) | response,
        response_mask=response,
        position_ids=positions,
        prompt_lengths=lengths,
        response_lengths=response_lengths,
        finished=done,
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(group),
        prompt_width=width,
        steps=steps,
    )
