"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): the layer
spec's ``core_attention`` slot with ``--attention-backend sdpa`` (the default).

Megatron's local ``DotProductAttention`` materializes the ``b x heads x s x s`` scores and keeps
their softmax (fp32, and a bf16 copy) for the backward. SDPA's flash and memory-efficient kernels
on CUDA work in tiles and keep only the output and the fp32 logsumexp (``b x heads x s``); on the
CPU torch's flash kernel does the same with per-thread tiles. :class:`SDPAttention` takes the
same constructor and forward arguments as ``DotProductAttention`` (query/key/value ``[s, b,
heads, head_dim]`` on this TP rank, Megatron's boolean mask; output ``[sq, b, heads x
head_dim]``) and computes the same function:

- **Scale**: ``softmax_scale`` or ``1/sqrt(kv_channels)``. ``apply_query_key_layer_scaling``
  divides the scores by the layer number and multiplies them back inside the softmax (an fp16
  overflow guard of the unfused path): the net scale is unchanged, so it is not applied here.
  The kernels keep the softmax statistics in fp32 whatever ``attention_softmax_in_fp32`` says.
- **Masks** (Megatron's convention: True = masked): no mask and a causal layer, or a mask equal
  to the causal one (the LM batches' :func:`~logra_megatron.models.build.causal_attention_mask`,
  a left-padded batch without padding), run with ``is_causal=True``, which CUDA's flash kernel
  serves. Any other mask (left-padded rollouts and probes, ``models/positions.py``; the KV-cache
  decode's ``[b, 1, 1, sk]`` pad-key mask) becomes an additive bias: 0 where allowed, the
  dtype's most negative finite value where masked. Where a row has a real key, the masked keys'
  weights are exactly 0, as the unfused ``masked_fill(-10000)`` gives in fp32. A row with every
  key masked (a left-padding query) sees the same huge value at every key, which swallows the
  score in rounding: it attends uniformly, exactly what the unfused path computes there (all
  scores -10000), and never NaN (with ``-inf`` some kernels divide 0 by 0, others return 0).
  The losses weigh those positions by 0, so no gradient comes back through them (if one did,
  the bias would pass it on to q and k, where the unfused ``masked_fill`` stops it).
- **Decoding with the KV cache** (``StaticInferenceContext``): Megatron passes ``no_mask`` for the
  one-query decode steps; without a mask a single query attends to every cached key, as the
  unfused path does, and with the engine's pad-key mask it is applied as above.
- **Packed sequences** (Megatron's ``PackedSeqParams``, ``thd``: query/key/value ``[t, heads,
  d]``, the sequences end to end at the offsets ``cu_seqlens``, no mask): causal SDPA once per
  sequence, so attention never crosses a boundary and no padding is computed (the GRPO passes'
  packed microbatches, ``models/positions.py`` ``pack_rows``; Megatron's rotary path restarts the
  positions at each offset). On CUDA in fp16/bf16 without dropout the whole microbatch is one
  variable-length flash call instead (``models/varlen_attention.py``).
- **Grouped-query attention**: key and value are repeated to the query heads per group before
  the call (as the unfused path does; CUDA's memory-efficient kernel, which masked batches need,
  has no grouped form).

The bias and the causal test are computed once per mask tensor and remembered on it (an
attribute of the mask, so they live exactly as long as it does): every layer of a forward (and
every microbatch of the LM step) receives the same mask object, so the conversion and the test's
host sync happen once per forward, and the layers save one bias tensor between them, not one
each (CUDA's memory-efficient kernel still saves a padded copy per layer when the key length is
not a multiple of 16). A ``b x s x s`` bias is the only quadratic term left, and only for
padded batches; the LM step's causal batches have none.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from logra_megatron.models.varlen_attention import flash_varlen, flash_varlen_usable

_REMEMBERED = "_logra_sdpa_mask"
"""The attribute of a mask tensor that holds what this module derived from it."""


class _DerivedMask:
    """What a boolean mask means to SDPA: whether it is the causal mask, and its additive bias
    per dtype (created on first use). Valid while the mask is not modified in place."""

    def __init__(self, mask: torch.Tensor):
        self.version = None if mask.is_inference() else mask._version
        self.causal = _is_causal(mask)
        self.bias = {}


def _is_causal(mask: torch.Tensor) -> bool:
    """True when ``mask`` ([..., s, s], True = masked) masks exactly the future keys of every
    query (a host sync on CUDA: once per mask)."""
    queries, keys = mask.shape[-2:]
    if queries != keys or queries == 1:
        return False
    future = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask, future.expand_as(mask))


def derived_mask(mask: torch.Tensor) -> _DerivedMask:
    """The remembered :class:`_DerivedMask` of ``mask`` (computed on first use, again after an
    in-place change)."""
    if mask.is_inference():  # no version counter to notice an in-place change by: not remembered
        return _DerivedMask(mask)
    derived = getattr(mask, _REMEMBERED, None)
    if derived is None or derived.version != mask._version:
        derived = _DerivedMask(mask)
        setattr(mask, _REMEMBERED, derived)
    return derived


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias of ``mask`` in ``dtype``, shared by every layer that receives it: 0 where
    the mask allows, the most negative finite ``dtype`` value where it masks (a fully masked row
    stays finite and uniform, as in the unfused path; see the module docstring)."""
    derived = derived_mask(mask)
    if dtype not in derived.bias:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        derived.bias[dtype] = bias.masked_fill_(mask, torch.finfo(dtype).min)
    return derived.bias[dtype]


class SDPAttention(MegatronModule):
    """``DotProductAttention``'s interface on ``torch.nn.functional.scaled_dot_product_attention``
    (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention has no context parallelism (Megatron serves it with Transformer Engine)")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention computes the vanilla softmax, not softmax_type={config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("SDPAttention has no sliding-window attention; use --attention-backend unfused")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # Heads on this TP rank, as DotProductAttention divides them (Attention passes a config
        # with num_query_groups raised to the TP size when there are fewer groups than ranks).
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias")
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, attention_mask, packed_seq_params)
        queries, batch = query.shape[:2]
        keys = key.shape[0]
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeats > 1:  # [sk, b, groups, d] -> [sk, b, heads, d], each group's heads adjacent
            key = key.repeat_interleave(repeats, dim=2)
            value = value.repeat_interleave(repeats, dim=2)

        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        bias, causal = None, False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
            causal = derived_mask(attention_mask).causal
            if not causal:
                bias = mask_bias(attention_mask, query.dtype)
        elif mask_type == AttnMaskType.causal and queries > 1:
            if queries != keys:
                raise ValueError(f"a causal layer without a mask needs as many queries as keys, got {queries} "
                                 f"and {keys} (pass the mask of a chunked prefill)")
            causal = True

        dropout = self.dropout_p if self.training else 0.0
        # [s, b, heads, d] -> [b, heads, s, d]: views (the kernels take strided inputs).
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        if dropout > 0.0 and not self.config.sequence_parallel:
            # The same RNG stream as DotProductAttention's dropout (different draws: another kernel).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                                         is_causal=causal, scale=self.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                                     is_causal=causal, scale=self.softmax_scale)
        # [b, heads, sq, d] -> [sq, b, heads x d]
        return context.permute(2, 0, 1, 3).reshape(queries, batch, self.hidden_size_per_partition)

    def _packed_forward(self, query, key, value, attention_mask, params: PackedSeqParams) -> torch.Tensor:
        """Packed sequences (Megatron's ``thd`` layout: query/key/value ``[t, heads, d]``, the
        sequences one after another at the offsets ``cu_seqlens``): causal attention within each
        sequence, never across a boundary; SDPA once per sequence. Output ``[t, heads x d]``
        (Megatron reshapes it to ``[t, 1, heads x d]``)."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention takes packed sequences in the thd layout, not {params.qkv_format!r}")
        if attention_mask is not None:
            raise ValueError("packed sequences take no attention_mask (cu_seqlens bounds the attention)")
        if self.attn_mask_type != AttnMaskType.causal and self.attn_mask_type != AttnMaskType.padding_causal:
            raise ValueError(f"SDPAttention packs causal self-attention only, not {self.attn_mask_type}")
        cu_q = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv_padded is None else params.cu_seqlens_kv_padded
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise ValueError("SDPAttention packs self-attention only (cu_seqlens_q == cu_seqlens_kv)")
        if query.dim() != 3:
            raise ValueError(f"packed query must be [t, heads, d], got {tuple(query.shape)}")
        total = query.shape[0]
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=1)
            value = value.repeat_interleave(repeats, dim=1)
        bounds = cu_q.tolist()  # one host sync per layer call
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {total}, got {bounds[0]}..{bounds[-1]}")
        dropout = self.dropout_p if self.training else 0.0
        if flash_varlen_usable(query, dropout):
            context = flash_varlen(query, key, value, bounds, self.softmax_scale)
            if context is not None:
                return context.reshape(total, self.hidden_size_per_partition)
        # [t, heads, d] -> [heads, t, d]: views
        q, k, v = (tensor.transpose(0, 1) for tensor in (query, key, value))
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            segment = slice(start, end)
            call = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q[:, segment].unsqueeze(0), k[:, segment].unsqueeze(0), v[:, segment].unsqueeze(0),
                dropout_p=dropout, is_causal=end - start > 1, scale=self.softmax_scale)
            if dropout > 0.0 and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    pieces.append(call()[0])
            else:
                pieces.append(call()[0])
        context = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]  # [heads, t, d]
        return context.transpose(0, 1).reshape(total, self.hidden_size_per_partition)
