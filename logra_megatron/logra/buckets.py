"""How LoGRA's sketch buffer is cut into buckets: one rule, torch-free, read by the buffer that
builds them (``logra/sketch_buffer.py``) and by the memory planner that counts their padding
(``planning/state.py``). Megatron's DDP cuts its dense gradient buffer the same way
(``param_and_grad_buffer.py``: a bucket closes once it holds ``bucket_size`` elements)."""

from typing import List, Optional


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
