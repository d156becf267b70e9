"""Projections: seeded random orthonormal bases and the randomized range finder.

Every rank that shares a projection must build the same one without communicating, so all
randomness is drawn from generators seeded by (base seed, the weight's global name, a counter):
the same on every TP, PP and DP rank, independent of the layout.
"""

import torch

from logra_megatron.seeding import seeded_gaussian


def random_orthonormal(dim: int, rank: int, seed: int) -> torch.Tensor:
    """A ``dim x rank`` matrix with orthonormal columns, reproducible from ``seed``."""
    q, r = torch.linalg.qr(seeded_gaussian(dim, rank, seed).double())
    # Fix QR's sign ambiguity so the result is a function of the seed alone.
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
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
    signs = torch.sign(u[index, torch.arange(u.shape[1])])
    return (u * signs).float().contiguous()
