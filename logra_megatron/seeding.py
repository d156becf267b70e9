"""Seeds that every rank derives alike without communicating: from a base seed, a tensor's
global name and a counter, independent of the TP/PP/DP layout. Used by the layout-independent
initialization (models/weights.py) and by LoGRA's projections (logra/projection.py)."""

import hashlib

import torch


def name_seed(base_seed: int, name: str, counter: int = 0) -> int:
    """A 63-bit seed from a base seed, a weight's global name and a counter."""
    digest = hashlib.sha256(f"{base_seed}/{name}/{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_gaussian(rows: int, cols: int, seed: int, device=None) -> torch.Tensor:
    """A ``rows x cols`` standard normal fp32 matrix, a function of ``seed`` and the device kind
    (drawn on ``device``, default the CPU, by that device's own generator: every rank of one
    device kind draws the same matrix)."""
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    return torch.randn(rows, cols, generator=generator, dtype=torch.float64, device=device).float()
