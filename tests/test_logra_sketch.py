"""The sketch written by the backward equals the projection of the dense gradient; the range
finder finds a planted subspace; bad LoGRA settings are one clear error."""

import types

import pytest
import torch

from logra_megatron.errors import UserError
from logra_megatron.logra import LogRAConfig, parse_rank
from logra_megatron.logra.projection import random_orthonormal, range_finder_basis
from logra_megatron.seeding import name_seed, seeded_gaussian
from logra_megatron.logra.sketch import LEFT, RIGHT, LinearSketch, sketched_linear


def owner_with(sketch):
    return types.SimpleNamespace(logra_sketch=sketch, logra_anchor=torch.empty(0, requires_grad=True))


def dense_gradient(x, weight, upstream):
    reference = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).double()
    with torch.no_grad():
        reference.weight.copy_(weight)
    (reference(x.detach()) * upstream).sum().backward()
    return reference.weight.grad


@pytest.mark.parametrize("side", [LEFT, RIGHT])
@pytest.mark.parametrize("out_features,in_features,rank", [(48, 32, 4), (32, 48, 8), (24, 24, 24), (64, 16, 1)])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_sketch_equals_projected_dense_gradient(side, out_features, in_features, rank, microbatches):
    torch.manual_seed(out_features * in_features + rank)
    weight = torch.randn(out_features, in_features, dtype=torch.float64)
    projected = in_features if side == RIGHT else out_features
    projection = random_orthonormal(projected, rank, seed=rank)
    sketch = LinearSketch("w", side, out_features, in_features, projection,
                          torch.zeros(LinearSketch.sketch_shape(side, out_features, in_features, rank)))
    owner = owner_with(sketch)
    dense = torch.zeros_like(weight)
    for _ in range(microbatches):
        x = torch.randn(5, 7, in_features, dtype=torch.float64)
        upstream = torch.randn(5, 7, out_features, dtype=torch.float64)
        x_sketched = x.clone().requires_grad_(True)
        out = sketched_linear(x_sketched, weight, None, owner, False, None)
        assert torch.allclose(out, x @ weight.t())
        (out * upstream).sum().backward()
        x_reference = x.clone().requires_grad_(True)
        dense += dense_gradient(x_reference, weight, upstream)
        (x_reference @ weight.t() * upstream).sum().backward()
        assert torch.allclose(x_sketched.grad, x_reference.grad)
    p = projection.double()
    expected = dense @ p if side == RIGHT else p.t() @ dense
    error = (sketch.sketch.double() - expected).norm() / expected.norm()
    assert error < 1e-5
    # Mapping back: with the projection's complement dropped, P P^T G (or G Q Q^T).
    back = sketch.update_from(sketch.sketch).double()
    assert torch.allclose(back, dense @ p @ p.t() if side == RIGHT else p @ p.t() @ dense, rtol=1e-4, atol=1e-4)


def test_bias_gradient_and_missing_sketch():
    weight = torch.randn(6, 4)
    bias = torch.randn(6, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = sketched_linear(x, weight, bias, owner_with(None), False, None)
    out.sum().backward()
    assert torch.allclose(bias.grad, torch.full((6,), 3.0))
    assert torch.allclose(x.grad, weight.sum(0).expand(3, 4))


def test_range_finder_recovers_planted_subspace():
    torch.manual_seed(0)
    m, n, rank = 96, 64, 6
    basis = torch.linalg.qr(torch.randn(m, rank))[0]
    gradient = basis @ torch.diag(torch.linspace(10, 5, rank)) @ torch.randn(rank, n) + 1e-3 * torch.randn(m, n)
    omega = seeded_gaussian(n, rank + 4, seed=1)
    found = range_finder_basis(gradient @ omega, rank)
    assert torch.allclose(found.t() @ found, torch.eye(rank), atol=1e-5)
    cosines = torch.linalg.svdvals(basis.t() @ found)  # cosines of the principal angles
    assert cosines.min() > 0.999


def test_projections_are_seeded_by_name():
    a = random_orthonormal(32, 4, name_seed(1, "decoder.layers.0.mlp.linear_fc1.weight"))
    b = random_orthonormal(32, 4, name_seed(1, "decoder.layers.0.mlp.linear_fc1.weight"))
    c = random_orthonormal(32, 4, name_seed(1, "decoder.layers.1.mlp.linear_fc1.weight"))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a.t() @ a, torch.eye(4), atol=1e-6)


def test_rank_resolution_and_bad_settings():
    assert LogRAConfig(rank=0.25).rank_for(64, "w") == 16
    assert LogRAConfig(rank=8).rank_for(64, "w") == 8
    assert parse_rank("16") == 16 and parse_rank("0.5") == 0.5
    with pytest.raises(UserError, match="larger than the matrix: w projects a dimension of 64"):
        LogRAConfig(rank=65).rank_for(64, "w")
    with pytest.raises(UserError, match="refresh-interval must be a positive"):
        LogRAConfig(refresh_interval=0)
    with pytest.raises(UserError, match="fraction must be in"):
        LogRAConfig(rank=1.5)
    with pytest.raises(UserError, match="must be an integer or a fraction"):
        parse_rank("big")
    with pytest.raises(UserError, match="second-moment"):
        LogRAConfig(second_moment="keep")
