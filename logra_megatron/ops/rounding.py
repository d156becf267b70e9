"""Stochastic rounding of fp32 values to bf16 with counter-based random bits.

``x`` is rounded to one of its two neighbouring bf16 values with probabilities proportional to
the distance from the other, so the rounding is unbiased (E[round(x)] = x): an update far smaller
than a bf16 ulp still moves the weight on average, where round-to-nearest would drop it every
step. This is what lets ``--logra-master bf16-sr`` keep no fp32 master copy.

The random bits of an element are a hash of (seed, the element's index in the full, unsharded
tensor), not draws from a stateful generator: every rank that holds the element computes the
same bits without communicating (data-parallel replicas stay bit-identical), a TP shard rounds
its elements exactly as the TP=1 tensor would, and a resumed run (same seed, same step)
reproduces. The hash is a 32-bit integer mixer evaluated in int64 with every product below
2^63, so it is exact on any device; it runs in place on two int64 tensors, about 30 passes
over them per element (the commit in ``logra/masters.py`` rounds blocks of
``ops/budgets.py: SR_BLOCK_ELEMENTS``).
"""

from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2^27: products of a 32-bit value with it stay below 2^59


def _mix32_scalar(x: int) -> int:
    """The 32-bit avalanche mixer on a Python int in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32_scalar` in place on an int64 tensor holding values in [0, 2^32); ``scratch``
    is an int64 tensor of its shape (no other temporary is allocated)."""
    for _ in range(2):
        torch.bitwise_right_shift(x, 16, out=scratch)
        x.bitwise_xor_(scratch).mul_(_MULTIPLIER).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=scratch)
    return x.bitwise_xor_(scratch)


def random_bits16(element_index: torch.Tensor, seed: int, index_limit: Optional[int] = None) -> torch.Tensor:
    """16 random bits (int64 in [0, 2^16)) per element, a function of ``seed`` and each entry of
    ``element_index`` (non-negative int64, below 2^62) alone: ``mix(mix(mix(high ^ s_lo) ^ low)
    ^ s_hi)`` of the index's 32-bit words and the seed's mixed words. ``index_limit``, when the
    caller knows it, bounds the indices (exclusive): at most 2^32, every high word is 0 and the
    first mix is one number, not a tensor pass (the bits are the same either way)."""
    seed_hi = _mix32_scalar((seed >> 32) & _MASK32)
    seed_lo = _mix32_scalar((seed & _MASK32) ^ seed_hi)
    if index_limit is not None and index_limit <= 1 << 32:
        x = element_index ^ _mix32_scalar(seed_lo)  # high word 0: mix(0 ^ s_lo) is a constant
        scratch = torch.empty_like(x)
    else:
        x = (element_index >> 32).bitwise_xor_(seed_lo)
        scratch = torch.empty_like(x)
        _mix32_(x, scratch)
        x.bitwise_xor_(torch.bitwise_and(element_index, _MASK32, out=scratch))
    _mix32_(x, scratch)
    _mix32_(x.bitwise_xor_(seed_hi), scratch)
    return x.bitwise_and_(0xFFFF)


def stochastic_round_to_bf16(values: torch.Tensor, element_index: torch.Tensor, seed: int,
                             index_limit: Optional[int] = None) -> torch.Tensor:
    """bf16 tensor of ``values`` (fp32), each rounded up or down at random, unbiased.

    Adding 16 random bits below the bf16 mantissa to the fp32 bit pattern and truncating them
    rounds the magnitude up with probability equal to the dropped fraction; the sign bit is
    untouched, so negative values round symmetrically. ``element_index`` has ``values``' shape
    (see :func:`random_bits16`, also for ``index_limit``). Non-finite values are passed through by
    round-to-nearest. Temporaries: three int64 tensors of ``values``' size at most (the index,
    the random bits and the bit pattern), the ops in place.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes fp32 values, got {values.dtype}")
    noise = random_bits16(element_index, seed, index_limit)
    bits = values.contiguous().view(torch.int32).to(torch.int64).bitwise_and_(_MASK32)
    bits.add_(noise).bitwise_right_shift_(16)  # [0, 2^16]: the bf16 pattern (2^16 only from a NaN)
    del noise
    bits.bitwise_xor_(0x8000).sub_(0x8000)  # as a signed 16-bit integer: [0, 2^16) -> [-2^15, 2^15)
    rounded = bits.to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(values)
    if values.device.type != "cpu":  # the same bits without a host sync per block on an accelerator
        return torch.where(finite, rounded, values.to(torch.bfloat16))
    if bool(finite.all()):
        return rounded
    return torch.where(finite, rounded, values.to(torch.bfloat16))
