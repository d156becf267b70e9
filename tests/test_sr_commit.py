"""The bf16-sr commit (logra/masters.py, ops/rounding.py) after its speed-up: the same bits as the
rounding as first written, an element's bits independent of its block, and the transient the
planner counts."""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra import masters as masters_module
from logra_megatron.ops import rounding
from logra_megatron.platform.memory import AllocationTracker

# --- the rounding as first written (three int64 mixes, a new tensor per op): the reference -------

_MASK32, _MULTIPLIER = 0xFFFFFFFF, 0x45D9F3B


def _reference_mix32(x):
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def _reference_bits16(element_index, seed):
    seed_hi = _reference_mix32(torch.tensor((seed >> 32) & _MASK32, dtype=torch.int64))
    seed_lo = _reference_mix32(torch.tensor(seed & _MASK32, dtype=torch.int64) ^ seed_hi)
    low, high = element_index & _MASK32, element_index >> 32
    x = _reference_mix32(_reference_mix32(high ^ seed_lo) ^ low)
    return _reference_mix32(x ^ seed_hi) & 0xFFFF


def _reference_round(values, element_index, seed):
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    bits = (bits + _reference_bits16(element_index, seed)) >> 16
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    rounded = bits.to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(values)
    return rounded if bool(finite.all()) else torch.where(finite, rounded, values.to(torch.bfloat16))


def _values(rows=64, cols=96):
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(rows, cols, generator=generator) * torch.logspace(-40, 38, cols)
    values[0, :9] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 3.39e38, -3.39e38,
                                  1e-45, -1.2e-38])
    return values


@pytest.mark.parametrize("base", [0, (1 << 32) - 3000, 5 << 40])
@pytest.mark.parametrize("seed", [0, 1234, (1 << 63) - 1, 0xDEADBEEFCAFE])
def test_the_rounding_has_the_bits_of_the_reference(base, seed):
    values = _values()
    index = torch.arange(values.numel(), dtype=torch.int64).reshape(values.shape) + base
    expected = _reference_round(values, index, seed).view(torch.int16)
    assert torch.equal(rounding.random_bits16(index, seed), _reference_bits16(index, seed))
    assert torch.equal(rounding.stochastic_round_to_bf16(values, index, seed).view(torch.int16), expected)
    limit = base + values.numel()
    assert torch.equal(rounding.random_bits16(index, seed, index_limit=limit), _reference_bits16(index, seed))
    got = rounding.stochastic_round_to_bf16(values, index, seed, index_limit=limit)
    assert torch.equal(got.view(torch.int16), expected)
    assert torch.equal(index, torch.arange(values.numel(), dtype=torch.int64).reshape(values.shape) + base)


def _bf16_sr_optimizer():
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.models import get_preset
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable

    parallel.initialize(1, 1)
    model_config = get_preset("tiny")
    _, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind="logra", lr=1e-3, weight_decay=0.1),
                                        LogRAConfig(rank=8, master="bf16-sr", embeddings=True),
                                        dtype=torch.bfloat16, seed=11)
    tokens = torch.randint(0, model_config.vocab, (2, 17), generator=torch.Generator().manual_seed(2))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, tokens, 2)
    assert optimizer.propose()[0]
    return optimizer


def _commit(optimizer, start):
    for entry, weight in zip(optimizer.masters.weights, start):
        entry.weight.data.copy_(weight)
    optimizer.masters.apply(optimizer.proposal.update, 1e-3, 0.1, step_count=3)
    return [entry.weight.detach().clone() for entry in optimizer.masters.weights]


def test_an_elements_bits_do_not_depend_on_its_block():
    """The rounding of a row block is the rounding of the whole tensor's rows: the random bits
    come from each element's index in the full tensor."""
    values = _values(rows=40)
    index = torch.arange(values.numel(), dtype=torch.int64).reshape(values.shape)
    whole = rounding.stochastic_round_to_bf16(values, index, 99, index_limit=values.numel())
    blocks = torch.cat([rounding.stochastic_round_to_bf16(values[rows], index[rows], 99, index_limit=values.numel())
                        for rows in (slice(0, 1), slice(1, 7), slice(7, 40))])
    assert torch.equal(whole.view(torch.int16), blocks.view(torch.int16))


def test_the_commit_with_blocks_of_one_row_moves_the_same_weights(monkeypatch):
    """Blocks of one row and of the default budget commit the same bf16 weights, but for the
    few elements whose fp32 value before rounding differs in its last bit (a GEMM of other
    shape sums in another order): those land one bf16 step apart."""
    optimizer = _bf16_sr_optimizer()
    start = [entry.weight.detach().clone() for entry in optimizer.masters.weights]
    whole = _commit(optimizer, start)
    monkeypatch.setattr(masters_module, "SR_BLOCK_ELEMENTS", 1)
    assert all(optimizer.masters.block_rows(entry) == 1 for entry in optimizer.masters.weights)
    one_row = _commit(optimizer, start)
    moved = sum(int((a != b).sum()) for a, b in zip(whole, start))
    differ = sum(int((a != b).sum()) for a, b in zip(whole, one_row))
    steps = max(int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max()) for a, b in zip(whole, one_row))
    assert moved > 1000 and differ <= moved * 1e-3 and steps <= 1, (moved, differ, steps)


def test_the_commit_transient_is_the_planners(monkeypatch):
    """One block's fp32 values and three int64 tensors (planning/activations.py ``_commit``),
    measured on the largest block: a budget of 2048 elements."""
    from logra_megatron.planning.activations import sr_commit_bytes

    optimizer = _bf16_sr_optimizer()
    budget = 2048
    monkeypatch.setattr(masters_module, "SR_BLOCK_ELEMENTS", budget)
    optimizer.masters.apply(optimizer.proposal.update, 1e-3, 0.1, step_count=3)  # caches the indices
    with AllocationTracker() as tracked:
        optimizer.masters.apply(optimizer.proposal.update, 1e-3, 0.1, step_count=4)
    planned = sr_commit_bytes([tuple(e.weight.shape) for e in optimizer.masters.weights], budget)
    assert planned <= tracked.peak_bytes <= 1.15 * planned, (tracked.peak_bytes, planned)


@pytest.mark.gpu
def test_the_rounding_on_cuda_has_the_bits_of_the_cpu():
    """On an accelerator the non-finite fix-up runs without a host sync: the same bits (a NaN is
    a NaN; its bit pattern is the device's bf16 conversion's)."""
    values = _values()
    index = torch.arange(values.numel(), dtype=torch.int64).reshape(values.shape) + (5 << 40)
    expected = rounding.stochastic_round_to_bf16(values, index, 1234)
    got = rounding.stochastic_round_to_bf16(values.cuda(), index.cuda(), 1234,
                                            index_limit=(5 << 40) + values.numel()).cpu()
    nan = values.isnan()
    assert got[nan].isnan().all()
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))
