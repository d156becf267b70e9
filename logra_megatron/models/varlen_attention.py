"""Packed causal attention in one kernel call on CUDA: torch's variable-length flash attention.

:class:`~logra_megatron.models.sdpa_attention.SDPAttention` serves Megatron's packed (``thd``)
sequences by calling SDPA once per sequence: exact everywhere, but one kernel launch (and on CUDA
one small, poorly filled grid) per sequence per layer. Where torch ships
``torch.nn.attention.varlen.varlen_attn`` (flash attention over ``cu_seqlens``: the kernel the
flash-attn package calls ``flash_attn_varlen_func``) and the call is one it serves (CUDA, fp16 or
bf16, no dropout: the varlen function takes no dropout), the whole microbatch is one call. The
function computes the same attention as the per-sequence loop, within flash attention's rounding.

Its keyword arguments changed between torch releases: torch 2.10 takes ``is_causal``; later
releases take ``window_size`` (``(-1, 0)`` is causal) and ``scale``. :func:`flash_varlen` reads the
installed signature once and fills what it finds; without ``scale`` the query is pre-scaled so
the kernel's default ``1/sqrt(d)`` gives the layer's scale.
"""

import inspect
import math
import warnings
from typing import Callable, Optional

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes flash attention computes in."""
MAX_HEAD_DIM = 256
"""Flash attention's largest head dimension."""


def _load_kernel() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


_kernel = _load_kernel()
"""torch's varlen flash attention, or None where this torch has none (replaced in tests)."""
_failed = False
"""Set when the kernel raised once (an unsupported GPU, say): the per-sequence path from then on."""
calls = 0
"""Packed attentions the kernel computed in this process (tools/benchmark_packing.py reports it,
so a GPU run says whether the packed side ran on the varlen kernel or on the per-sequence loop)."""


def flash_varlen_usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether the packed attention of ``query`` ([t, heads, d]) can be one varlen flash call."""
    return (_kernel is not None and not _failed and query.is_cuda and query.dtype in HALF_DTYPES
            and dropout == 0.0 and query.shape[-1] <= MAX_HEAD_DIM and query.shape[-1] % 8 == 0)


def flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list,
                 scale: float) -> Optional[torch.Tensor]:
    """Causal attention of each packed sequence (``bounds``: the offsets, 0 .. t) in one call:
    query/key/value ``[t, heads, d]`` (key and value with as many heads as the query), output
    ``[t, heads, d]``. None if the kernel refused the call (warned once; the caller falls back)."""
    global _failed, calls
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
    parameters = inspect.signature(_kernel).parameters
    options = {}
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal: every key to the left, none to the right
    else:
        options["is_causal"] = True
    if "scale" in parameters:
        options["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(d): fold the ratio into the query
        query = query * (scale * math.sqrt(query.shape[-1]))
    try:
        output = _kernel(query, key, value, cu_seqlens, cu_seqlens, longest, longest, **options)
        calls += 1
        return output
    except RuntimeError as error:
        _failed = True
        warnings.warn(f"varlen flash attention refused a packed microbatch ({error}); packed attention runs "
                      "one SDPA call per sequence from now on")
        return None
