"""Projections: seeded random orthonormal bases, the randomized range finder, and the
Rademacher projections of ``--logra-update rowadam``.

Every rank that shares a projection must build the same one without communicating, so all
randomness is drawn from generators seeded by (base seed, the weight's global name, a counter):
the same on every TP, PP and DP rank, independent of the layout.
"""

import math

import torch

from logra_megatron.seeding import seeded_gaussian


def random_orthonormal(dim: int, rank: int, seed: int, device=None) -> torch.Tensor:
    """A ``dim x rank`` matrix with orthonormal columns on ``device``, reproducible from
    ``seed`` (on one device kind)."""
    q, r = torch.linalg.qr(seeded_gaussian(dim, rank, seed, device=device).double())
    # Fix QR's sign ambiguity so the result is a function of the seed alone.
    diagonal = torch.diagonal(r)
    q = q * torch.sign(diagonal).where(diagonal != 0, torch.ones_like(diagonal))
    return q.float().contiguous()


def range_finder_basis(sample: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-``rank`` left singular vectors of the range sample ``Y = G Omega`` (``dim x (r+p)``).

    These capture more gradient energy than the first r columns of a QR of Y
    (docs/ALGORITHM.md, "Refresh"). Signs are normalized (largest entry of each column positive) so that identical
    inputs give identical bases on every rank.
    """
    u, _, _ = torch.linalg.svd(sample.double(), full_matrices=False)
    u = u[:, :rank]
    index = u.abs().argmax(dim=0)
    signs = torch.sign(u[index, torch.arange(u.shape[1], device=u.device)])
    return (u * signs).float().contiguous()


def rademacher(dim: int, rank: int, seed: int, device=None) -> torch.Tensor:
    """A ``dim x rank`` matrix of independent signs / sqrt(rank), reproducible from ``seed``.

    Not orthonormal, but ``E[Q Q^T] = I``: a sketch ``G Q`` mapped back as ``(G Q) Q^T`` is an
    unbiased estimate of ``G``, and ``||G Q||^2`` of ``||G||^2`` (docs/ALGORITHM.md, "RowAdam").
    The draw depends on the seed and the shape only, so every rank that shares the projection
    (the whole projected dimension is never split) builds the same one at any layout.
    """
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    signs = torch.randint(0, 2, (dim, rank), generator=generator, dtype=torch.int8, device=device)
    return (signs.float() * 2.0 - 1.0).div_(math.sqrt(rank)).contiguous()
