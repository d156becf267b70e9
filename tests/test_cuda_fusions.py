"""Megatron's fusions that need no Transformer Engine (bias + SwiGLU, bias + dropout + add: torch
jit kernels) are on where Megatron-LM turns them on, on CUDA (``models/build.py:
transformer_config``), and change nothing but speed: a model built with them gives the unfused
model's logits and gradients from the same weights. The kernels are torch.jit functions that run
on the CPU as well, so the comparison runs here on the CPU and, ``gpu``-marked, on CUDA."""

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from dist_harness import REPO
from logra_megatron.models import build as build_module
from logra_megatron.models.config import get_preset

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion")

# One process: the tiny model unfused, then with the fusions, from the same full weights; the
# largest differences of logits and of every parameter's gradient under a next-token loss.
COMPARE = r"""
import json, sys, torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from logra_megatron import parallel
from logra_megatron.models import build_gpt_model, causal_attention_mask, get_preset
from logra_megatron.models.build import gpt_layer_spec, transformer_config
from logra_megatron.models.weights import full_state, load_full_state
from logra_megatron.platform import default_device

parallel.initialize(1, 1, seed=7)
tiny = get_preset("tiny")
device = default_device()
tokens = torch.randint(0, tiny.vocab, (2, 17), generator=torch.Generator().manual_seed(3)).to(device)
mask = causal_attention_mask(16, device=device)
positions = torch.arange(16, device=device).expand(2, 16)
outputs, state = {}, None
for fused in (False, True):
    config = transformer_config(tiny)
    for name in ("bias_activation_fusion", "bias_dropout_fusion"):
        setattr(config, name, fused)
    model = build_gpt_model(tiny, config, gpt_layer_spec(use_transformer_engine=False, attention_backend="sdpa"))
    if state is None:
        state = full_state(model)
    with torch.no_grad():
        load_full_state(model, state)
    logits = model(tokens[:, :-1], positions, mask)
    loss = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(), tokens[:, 1:].t().contiguous()).mean()
    loss.backward()
    outputs[fused] = (logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
(l0, g0), (l1, g1) = outputs[False], outputs[True]
print(json.dumps({"device": str(device),
                  "logits_max_abs": float((l0 - l1).abs().max()),
                  "grad_max_abs": max(float((g0[n] - g1[n]).abs().max()) for n in g0),
                  "grad_scale": max(float(g0[n].abs().max()) for n in g0)}))
"""


def compare():
    proc = subprocess.run([sys.executable, "-c", COMPARE], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fusions_are_on_exactly_on_cuda():
    tiny = get_preset("tiny")
    with mock.patch.object(build_module, "cuda_available", return_value=True):
        on_cuda = build_module.transformer_config(tiny)
    on_cpu = build_module.transformer_config(tiny)
    for name in FUSIONS:
        assert getattr(on_cuda, name) is True and getattr(on_cpu, name) is False, name
    # Apex's wgrad kernel is not installed here: the fusion that needs it stays off even on CUDA
    assert on_cuda.gradient_accumulation_fusion is False and on_cpu.gradient_accumulation_fusion is False


def test_fused_and_unfused_models_agree():
    report = compare()
    assert report["logits_max_abs"] < 1e-5, report
    assert report["grad_max_abs"] < 1e-5 * max(report["grad_scale"], 1.0), report


@pytest.mark.gpu
def test_fused_and_unfused_models_agree_on_cuda():
    report = compare()
    assert report["device"].startswith("cuda"), report
    assert report["logits_max_abs"] < 1e-4, report
    assert report["grad_max_abs"] < 1e-4 * max(report["grad_scale"], 1.0), report
