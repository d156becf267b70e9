"""Element budgets of the ops that work on a large tensor a piece at a time.

Plain numbers, free of torch, so the memory planner (``logra_megatron/planning``, which imports
no torch) models the transients with the same figures the ops use.
"""

NORM_CHUNK_ELEMENTS = 1 << 22
"""Elements per chunk of :func:`logra_megatron.ops.norms.squared_norm` (equal to its
``CHUNK_ELEMENTS``; tests/test_chunked_reductions.py checks it): two fp64 chunks are live at once."""

KL_CHUNK_ELEMENTS = 1 << 23
"""Logit elements (token positions x this rank's vocabulary slice) per chunk of the KL
controller's reductions (:func:`logra_megatron.ops.vocab_parallel.masked_kl_sum`,
``masked_half_variance_sum``): 8 Mi, i.e. 32 MiB per fp32 copy (170 positions of a 49k
vocabulary, 55 of a 152k one); at least one position per chunk."""

SR_BLOCK_ELEMENTS = 1 << 20
"""Elements per row block of a bf16-sr commit (:mod:`logra_megatron.logra.masters`): the block's
fp32 values and its integer temporaries of the stochastic rounding, at least one row."""


def kl_chunk_rows(local_vocab: int, chunk_elements: int = KL_CHUNK_ELEMENTS) -> int:
    """Token positions per chunk of the KL reductions for a vocabulary slice of ``local_vocab``
    (the same on every TP rank, so each rank runs the same collectives)."""
    return max(1, chunk_elements // max(1, local_vocab))
