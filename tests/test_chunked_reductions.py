"""The reductions that take a large tensor a chunk at a time (issue 25, "the copies gone"):
``ops/norms.py: squared_norm`` (LoGRA's sketch and norm-probe norms) and the KL controller's
masked sums (``ops/vocab_parallel.py``), at TP1: the same results as the whole-tensor
computation, a transient of a few chunks, and the planner's model of it (the TP2 sums:
tests/rl/test_rl_vocab_parallel.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from logra_megatron import parallel
from logra_megatron.ops import budgets, norms
from logra_megatron.ops.vocab_parallel import masked_half_variance_sum, masked_kl_sum, vocab_parallel_kl
from logra_megatron.platform.memory import AllocationTracker


def test_the_planner_reads_the_chunk_sizes_the_ops_use():
    assert budgets.NORM_CHUNK_ELEMENTS == norms.CHUNK_ELEMENTS


# --- squared norms ---------------------------------------------------------------------------

@pytest.mark.parametrize("numel,chunk", [(1, 4), (1001, 7), (4099, 1000), (4099, 4099), (4099, 10**6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_squared_norm_equals_the_fp64_reference(numel, chunk, dtype):
    generator = torch.Generator().manual_seed(numel)
    tensor = (torch.randn(numel, generator=generator) * 3).to(dtype)
    got = norms.squared_norm(tensor, chunk_elements=chunk)
    expected = tensor.double().pow(2).sum()
    assert got.dtype == torch.float64 and got.dim() == 0 and got.device == tensor.device
    assert math.isclose(float(got), float(expected), rel_tol=1e-14)


def test_squared_norm_of_a_matrix_and_of_nothing():
    matrix = torch.arange(35, dtype=torch.float32).reshape(5, 7) - 17
    assert float(norms.squared_norm(matrix, chunk_elements=6)) == float(matrix.double().pow(2).sum())
    assert float(norms.squared_norm(torch.zeros(0))) == 0.0


def test_squared_norm_keeps_no_copy_of_the_whole_buffer_as_the_planner_counts():
    from logra_megatron.planning.activations import norm_chunk_bytes

    buffer = torch.randn(1 << 16)
    with AllocationTracker() as tracked:
        norms.squared_norm(buffer, chunk_elements=1 << 10)
    planned = norm_chunk_bytes(buffer.numel(), 1 << 10)  # two fp64 chunks, not 8 bytes x 64 Ki
    assert planned <= tracked.peak_bytes <= planned + 4096, (tracked.peak_bytes, planned)


def _one_logra_step(monkeypatch, chunk, calls):
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.logra import grad_norm as grad_norm_module
    from logra_megatron.logra import sketch_buffer as sketch_buffer_module
    from logra_megatron.models import get_preset
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable, train_step

    def counted(tensor):
        calls.append(tensor.numel())
        return norms.squared_norm(tensor, chunk_elements=chunk)

    monkeypatch.setattr(sketch_buffer_module, "squared_norm", counted)
    monkeypatch.setattr(grad_norm_module, "squared_norm", counted)
    parallel.initialize(1, 1)
    model_config = get_preset("tiny")
    _, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind="logra", clip_grad=1.0),
                                        LogRAConfig(rank=8, embeddings=True), seed=7)
    tokens = torch.randint(0, model_config.vocab, (2, 17), generator=torch.Generator().manual_seed(3))
    train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, 2))
    return optimizer.diagnostics(), optimizer.sketch_buffer.flat.numel()


def test_the_clipping_norm_is_summed_in_chunks_and_does_not_depend_on_their_size(monkeypatch):
    """LoGRA's sketch norm and its norm probes' residual go through ``squared_norm``: a chunk of
    7 elements (dividing neither buffer) gives the clipping norm of the default chunk."""
    tiny_calls, default_calls = [], []
    tiny, sketch_numel = _one_logra_step(monkeypatch, 7, tiny_calls)
    default, _ = _one_logra_step(monkeypatch, norms.CHUNK_ELEMENTS, default_calls)
    assert sketch_numel in tiny_calls and len(tiny_calls) >= 2  # the sketch buffer and the probes
    assert sketch_numel % 7 and all(numel > 7 for numel in tiny_calls)
    assert tiny_calls == default_calls
    for key in ("grad_norm", "grad_norm_sketch"):
        assert default[key] > 0
        assert math.isclose(tiny[key], default[key], rel_tol=1e-12), (key, tiny, default)


# --- the KL controller's sums ----------------------------------------------------------------

def _logits(dtype, rows=3, positions=37, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, positions, vocab, generator=generator, dtype=torch.float64) * 2
    new = old + 0.3 * torch.randn(rows, positions, vocab, generator=generator, dtype=torch.float64)
    mask = (torch.rand(rows, positions, generator=generator) > 0.3).float()
    return old.to(dtype), new.to(dtype), mask


@pytest.fixture
def single_rank():
    parallel.initialize(1, 1)
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_kl_sum_in_token_chunks_equals_the_whole(single_rank, dtype):
    old, new, mask = _logits(dtype)
    vocab = old.shape[-1]
    whole = masked_kl_sum(old, new, mask, chunk_elements=10**9)
    for rows in (1, 4, 7, 110):  # 111 positions: none of these divides them
        chunked = masked_kl_sum(old, new, mask, chunk_elements=rows * vocab + vocab - 1)
        assert math.isclose(chunked, whole, rel_tol=1e-13), (rows, chunked, whole)
    # Per token, a chunk's KL is exactly the whole tensor's (the same row-wise arithmetic).
    per_token = vocab_parallel_kl(old, new).reshape(-1)
    chunk = vocab_parallel_kl(old.reshape(-1, vocab)[40:47], new.reshape(-1, vocab)[40:47])
    assert torch.equal(chunk, per_token[40:47])
    # And it is the KL: the fp64 full-vocabulary reference.
    log_p, log_q = F.log_softmax(old.double(), -1), F.log_softmax(new.double(), -1)
    expected = float(((log_p.exp() * (log_p - log_q)).sum(-1) * mask.double()).sum())
    assert math.isclose(whole, expected, rel_tol=1e-12 if dtype == torch.float64 else 1e-5)


def test_the_linear_forecast_in_token_chunks_equals_the_whole(single_rank):
    old, new, mask = _logits(torch.bfloat16, seed=1)
    vocab, epsilon = old.shape[-1], 1.0
    whole = masked_half_variance_sum(old, new, epsilon, mask, chunk_elements=10**9)
    chunked = masked_half_variance_sum(old, new, epsilon, mask, chunk_elements=5 * vocab)
    assert math.isclose(chunked, whole, rel_tol=1e-13)
    p = F.softmax(old.double(), -1)
    delta = (new.double() - old.double()) / epsilon
    mean = (p * delta).sum(-1)
    expected = float((0.5 * ((p * delta.square()).sum(-1) - mean.square()) * mask.double()).sum())
    assert whole > 0 and math.isclose(whole, expected, rel_tol=1e-12)
    fp64 = old.double()
    masked_half_variance_sum(fp64, new.double(), epsilon, mask, chunk_elements=5 * vocab)
    assert torch.equal(fp64, old.double())  # fp64 logits are copied, not changed in place


@pytest.mark.parametrize("mode", ["probe", "linear"])
def test_the_kl_sums_hold_three_chunks_as_the_planner_counts(single_rank, mode):
    """The transient of one forecast side's reduction, measured, against the planner's term
    (planning/activations.py ``_probe_kl``: three chunk-sized fp32 / fp64 copies)."""
    from logra_megatron.planning.activations import kl_reduction_bytes

    old, new, mask = _logits(torch.bfloat16, rows=2, positions=400, vocab=512, seed=2)
    vocab = old.shape[-1]
    chunk_elements = 64 * vocab  # 64 positions per chunk, 800 positions

    def run(chunk):
        with AllocationTracker() as tracked:
            if mode == "linear":
                masked_half_variance_sum(old, new, 1.0, mask, chunk_elements=chunk)
            else:
                masked_kl_sum(old, new, mask, chunk_elements=chunk)
        return tracked.peak_bytes

    planned = kl_reduction_bytes(800, vocab, mode, chunk_elements)
    chunked = run(chunk_elements)
    assert planned <= chunked <= planned * 1.05, (chunked, planned)
    assert run(10**9) > 10 * chunked  # the whole microbatch at once: 12.5x the chunk's positions
