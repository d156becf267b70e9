"""How LoGRA's sketch buffer is laid out and cut into buckets: one rule, torch-free, read by the
buffer that builds them (``logra/sketch_buffer.py``) and by the memory planner that counts its
length (``planning/state.py``). Megatron's DDP cuts its dense gradient buffer the same way
(``param_and_grad_buffer.py``: a bucket closes once it holds ``bucket_size`` elements)."""

from typing import List, Optional, Tuple

from logra_megatron.ops.multiples import round_up


def plan_buckets(numels: List[int], isolate: List[bool], bucket_numel: Optional[int]) -> List[List[int]]:
    """Indices of consecutive weights per bucket: a bucket is closed once it holds at least
    ``bucket_numel`` elements (None: one bucket for everything), and a weight marked in
    ``isolate`` gets a bucket of its own (a tied embedding under ZeRO-1: its bucket is then laid
    out alike on the first and the last pipeline stage, so the two stages' reduced parts of it
    can be summed after the DP reduction, as Megatron buckets shared embeddings)."""
    buckets: List[List[int]] = []
    filled = 0
    for index, numel in enumerate(numels):
        closed = bool(buckets) and (isolate[buckets[-1][-1]] or isolate[index]
                                    or (bucket_numel is not None and filled >= bucket_numel))
        if not buckets or closed:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += numel
    return buckets


def bucket_layout(numels: List[int], shared_embedding: List[bool], bucket_numel: Optional[int],
                  dp: int, zero1: bool) -> Tuple[List[int], List[Tuple[List[int], int, int]], int]:
    """The flat sketch buffer of weights with ``numels`` elements, in order: ``(offsets, buckets,
    length)``, each weight's offset, each bucket's ``(weight indices, start, end)``, and the
    buffer's length.
    Buckets as :func:`plan_buckets` cuts them, a shared embedding's alone when ZeRO-1 has several
    (``shared_embedding``: the weight is the tied embedding of a pipeline over several stages);
    under ZeRO-1 every bucket is padded to a multiple of ``dp`` so each rank owns ``1 / dp`` of it."""
    isolate = [zero1 and bucket_numel is not None and shared for shared in shared_embedding]
    offsets, buckets, total = [0] * len(numels), [], 0
    for indices in plan_buckets(numels, isolate, bucket_numel):
        start = total
        for index in indices:
            offsets[index] = total
            total += numels[index]
        if zero1:
            total = round_up(total, dp)
        buckets.append((indices, start, total))
    return offsets, buckets, total
