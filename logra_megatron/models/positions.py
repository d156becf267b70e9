"""Masks and rotary positions for left-padded batches, and the packed layout of the same rows:
every row computes what its sequence alone would (rollouts and the GRPO passes share them).

Packed (:func:`pack_rows`): a batch's real tokens, row after row, as one ``[1, t]`` sequence with
Megatron's :class:`PackedSeqParams` (``thd``, ``cu_seqlens`` at the row boundaries). Megatron's
rotary path restarts the positions at each ``cu_seqlens`` offset (``_apply_rotary_pos_emb_thd``)
and the core attention (:class:`~logra_megatron.models.sdpa_attention.SDPAttention`) never
attends across one, so no row sees another and no padding is computed."""

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from logra_megatron.models.build import unwrap_model


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask ([B, 1, S, S], True = masked) for a left-padded batch: causal, and
    no query attends to a padding key. ``attention_mask`` is [B, S] bool, True at real tokens."""
    seq = attention_mask.shape[1]
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device), 1)
    return future[None, None] | ~attention_mask[:, None, None, :]


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
    gpt = unwrap_model(model)
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


@dataclass
class PackedRows:
    """Rows of a left/right-padded batch packed end to end (see the module docstring)."""

    tokens: torch.Tensor
    """[1, t] int64: the rows' real tokens, row after row (then ``pad`` filler, its own segment)."""
    position_ids: torch.Tensor
    """[1, t] int64: each token's position within its own row (0 at its first real token)."""
    params: PackedSeqParams
    """Megatron's ``thd`` parameters: ``cu_seqlens`` at the row boundaries (and the filler's)."""
    rows: torch.Tensor
    """[n] int64: the batch row of each of the first ``n`` (real) packed tokens."""
    slots: torch.Tensor
    """[n] int64: the column of each real packed token in its padded row."""
    real_tokens: int
    """n: real tokens; the ``t - n`` after them are filler."""
    predicts: torch.Tensor
    """[n] bool: the real packed tokens followed by one of their own row (all but each row's last)."""

    def to(self, device) -> "PackedRows":
        """The same rows on ``device`` (self when they are there already)."""
        if self.tokens.device == torch.device(device):
            return self
        params = dataclasses.replace(self.params, cu_seqlens_q=self.params.cu_seqlens_q.to(device),
                                     cu_seqlens_kv=self.params.cu_seqlens_kv.to(device))
        return dataclasses.replace(self, tokens=self.tokens.to(device), position_ids=self.position_ids.to(device),
                                   params=params, rows=self.rows.to(device), slots=self.slots.to(device),
                                   predicts=self.predicts.to(device))

    def next_tokens(self) -> torch.Tensor:
        """[1, t]: the token each position predicts (the next packed token; meaningless at a row's
        last token and in the filler, which :meth:`unpack` drops)."""
        return torch.roll(self.tokens, -1, dims=1)

    def unpack(self, values: torch.Tensor, shape, fill: float = 0.0) -> torch.Tensor:
        """``values`` ([1, t] or [t], per packed position t' = a prediction of token t'+1) in the
        padded ``[rows, columns - 1]`` layout ``shape`` (column c scores token c + 1), ``fill``
        where no real token predicts a real one. Differentiable in ``values``."""
        values = values.reshape(-1)[: self.real_tokens]
        keep = self.predicts  # a row's last token predicts nothing
        out = torch.full(tuple(shape), fill, dtype=values.dtype, device=values.device)
        return out.index_put((self.rows[keep], self.slots[keep]), values[keep])


def pack_rows(tokens: torch.Tensor, attention_mask: torch.Tensor, pad_to: Optional[int] = None,
              pad_id: int = 0) -> PackedRows:
    """The real tokens of ``tokens`` ([B, S]; ``attention_mask`` [B, S] bool, True at real tokens,
    contiguous in each row) packed into one sequence. ``pad_to`` (at least the real token count)
    appends filler as one more segment (equal shapes for the pipeline's send/receive). Rows with
    no real token take no segment."""
    mask = attention_mask.bool()
    rows, slots = mask.nonzero(as_tuple=True)  # row-major: each row's real tokens in order
    lengths = mask.sum(dim=1)
    first = torch.where(lengths > 0, mask.int().argmax(dim=1), torch.zeros_like(lengths))
    real = int(rows.numel())
    predicts = torch.zeros(real, dtype=torch.bool, device=tokens.device)
    predicts[:-1] = rows[1:] == rows[:-1]
    packed = tokens[rows, slots]
    positions = slots - first[rows]
    seqlens = lengths[lengths > 0]
    total = real if pad_to is None else int(pad_to)
    if total < real:
        raise ValueError(f"pad_to={total} is shorter than the {real} real tokens")
    if total > real:
        filler = total - real
        packed = torch.cat([packed, torch.full((filler,), pad_id, dtype=packed.dtype, device=packed.device)])
        positions = torch.cat([positions, torch.arange(filler, dtype=positions.dtype, device=positions.device)])
        seqlens = torch.cat([seqlens, seqlens.new_tensor([filler])])
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=tokens.device)
    cu_seqlens[1:] = torch.cumsum(seqlens, 0)
    longest = int(seqlens.max()) if seqlens.numel() else 0
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return PackedRows(tokens=packed[None], position_ids=positions[None], params=params, rows=rows,
                      slots=slots, real_tokens=real, predicts=predicts)
