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
2^63, so it is exact on any device.
"""

import torch

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2^27: products of a 32-bit value with it stay below 2^59


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer on int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def random_bits16(element_index: torch.Tensor, seed: int) -> torch.Tensor:
    """16 random bits (int64 in [0, 2^16)) per element, a function of ``seed`` and each entry of
    ``element_index`` (non-negative int64, below 2^62) alone."""
    seed_hi = _mix32(torch.tensor((seed >> 32) & _MASK32, dtype=torch.int64))
    seed_lo = _mix32(torch.tensor(seed & _MASK32, dtype=torch.int64) ^ seed_hi)
    low = element_index & _MASK32
    high = element_index >> 32
    x = _mix32(_mix32(high ^ seed_lo.to(element_index.device)) ^ low)
    return _mix32(x ^ seed_hi.to(element_index.device)) & 0xFFFF


def stochastic_round_to_bf16(values: torch.Tensor, element_index: torch.Tensor, seed: int) -> torch.Tensor:
    """bf16 tensor of ``values`` (fp32), each rounded up or down at random, unbiased.

    Adding 16 random bits below the bf16 mantissa to the fp32 bit pattern and truncating them
    rounds the magnitude up with probability equal to the dropped fraction; the sign bit is
    untouched, so negative values round symmetrically. ``element_index`` has ``values``' shape
    (see :func:`random_bits16`). Non-finite values are passed through by round-to-nearest.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes fp32 values, got {values.dtype}")
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    bits = (bits + random_bits16(element_index, seed)) >> 16  # [0, 2^16]: the bf16 pattern
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # as a signed 16-bit integer
    rounded = bits.to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return rounded
    return torch.where(finite, rounded, values.to(torch.bfloat16))
