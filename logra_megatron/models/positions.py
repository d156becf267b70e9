"""Masks and rotary positions for left-padded batches: every row computes what its sequence
alone would (rollouts and the GRPO passes share them)."""

import contextlib

import torch

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
