"""Packed attention as one variable-length flash call on CUDA (models/varlen_attention.py).

On the CPU the real kernel does not run, so the adapter is tested against stand-ins with the two
signatures torch has shipped (``is_causal`` without ``scale``; ``window_size`` with ``scale``):
each computes what the kernel's documentation says from the arguments it receives, so passing
the wrong offsets, lengths, causality or scale changes the result. The ``gpu`` test runs the
real kernel against the per-sequence SDPA loop, forward and backward.
"""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from logra_megatron.models import sdpa_attention, varlen_attention
from logra_megatron.models.sdpa_attention import SDPAttention

LENGTHS = (5, 1, 9, 3)
HEADS, GROUPS, HEAD_DIM = 4, 2, 16


def _attention(device="cpu", dtype=torch.float32) -> SDPAttention:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, params_dtype=dtype,
                               attention_dropout=0.0)  # the varlen call has no dropout
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank).to(device)


def _packed(device="cpu", dtype=torch.float32, requires_grad=False):
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    shapes = ((total, HEADS, HEAD_DIM), (total, GROUPS, HEAD_DIM), (total, GROUPS, HEAD_DIM))
    tensors = [torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_(requires_grad)
               for shape in shapes]
    offsets = [0]
    for length in LENGTHS:
        offsets.append(offsets[-1] + length)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    return tensors, params


def _documented_kernel(calls, *, new_signature: bool):
    """A stand-in for ``varlen_attn`` that computes what its documentation says, per sequence."""

    def attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale):
        calls.append(dict(dtype=cu_seq_q.dtype, device=cu_seq_q.device, max_q=max_q, max_k=max_k))
        bounds = cu_seq_q.tolist()
        assert cu_seq_k.tolist() == bounds
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1))
        return torch.cat(out)

    if new_signature:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            assert window_size in ((-1, -1), (-1, 0))
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None)
    return varlen_attn


@pytest.mark.parametrize("new_signature", (True, False), ids=("window_size-and-scale", "is_causal"))
@pytest.mark.parametrize("softmax_scale", (None, 0.3))
def test_one_varlen_call_equals_the_per_sequence_loop(monkeypatch, new_signature, softmax_scale):
    calls = []
    (query, key, value), params = _packed()
    attention = _attention()
    if softmax_scale is not None:
        attention.softmax_scale = softmax_scale
    expected = attention(query, key, value, None, packed_seq_params=params)  # the per-sequence loop
    monkeypatch.setattr(varlen_attention, "_kernel", _documented_kernel(calls, new_signature=new_signature))
    monkeypatch.setattr(sdpa_attention, "flash_varlen_usable", lambda query, dropout: True)
    got = attention(query, key, value, None, packed_seq_params=params)
    assert calls == [dict(dtype=torch.int32, device=query.device, max_q=max(LENGTHS), max_k=max(LENGTHS))]
    assert got.shape == expected.shape == (sum(LENGTHS), HEADS * HEAD_DIM)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_varlen_call_is_chosen_only_where_flash_attention_serves_it(monkeypatch):
    monkeypatch.setattr(varlen_attention, "_kernel", lambda *args, **kwargs: None)
    query = torch.zeros(4, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    assert not varlen_attention.flash_varlen_usable(query, 0.0)  # the CPU: no flash varlen kernel
    cuda_like = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(4, HEADS, HEAD_DIM))
    assert varlen_attention.flash_varlen_usable(cuda_like, 0.0)
    assert not varlen_attention.flash_varlen_usable(cuda_like, 0.1)  # no dropout in the varlen call
    assert not varlen_attention.flash_varlen_usable(types.SimpleNamespace(**{**vars(cuda_like), "dtype": torch.float32}), 0.0)
    assert not varlen_attention.flash_varlen_usable(types.SimpleNamespace(**{**vars(cuda_like), "shape": (4, 2, 512)}), 0.0)
    monkeypatch.setattr(varlen_attention, "_kernel", None)  # a torch without the kernel
    assert not varlen_attention.flash_varlen_usable(cuda_like, 0.0)


def test_a_refused_call_falls_back_to_the_per_sequence_loop_and_says_so(monkeypatch):
    (query, key, value), params = _packed()
    attention = _attention()
    expected = attention(query, key, value, None, packed_seq_params=params)

    def refuses(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(varlen_attention, "_kernel", refuses)
    monkeypatch.setattr(varlen_attention, "_failed", False)
    monkeypatch.setattr(sdpa_attention, "flash_varlen_usable", lambda query, dropout: True)
    with pytest.warns(UserWarning, match="one SDPA call per sequence"):
        got = attention(query, key, value, None, packed_seq_params=params)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert varlen_attention._failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU tests above cover the adapter)")
def test_the_real_varlen_kernel_equals_the_per_sequence_loop_on_cuda():
    if varlen_attention._kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    (query, key, value), params = _packed("cuda", torch.bfloat16, requires_grad=True)
    attention = _attention("cuda", torch.bfloat16)
    assert varlen_attention.flash_varlen_usable(query, 0.0)
    fused = attention(query, key, value, None, packed_seq_params=params)
    grads_fused = torch.autograd.grad(fused.float().square().sum(), (query, key, value))
    original = sdpa_attention.flash_varlen_usable
    sdpa_attention.flash_varlen_usable = lambda query, dropout: False
    try:
        loop = attention(query, key, value, None, packed_seq_params=params)
        grads_loop = torch.autograd.grad(loop.float().square().sum(), (query, key, value))
    finally:
        sdpa_attention.flash_varlen_usable = original
    assert not varlen_attention._failed
    torch.testing.assert_close(fused.float(), loop.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_fused, grads_loop):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * math.sqrt(HEAD_DIM))
