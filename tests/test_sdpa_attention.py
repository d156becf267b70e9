"""SDPA core attention (``--attention-backend sdpa``, logra_megatron/models/sdpa_attention.py)
against Megatron's unfused DotProductAttention, and the memory planner's model of it.

Multi-rank checks run once under torchrun (tests/workers/sdpa_checks.py: 2 ranks, TP=1 and TP=2
from the same full weights): logits and gradients on causal and left-padded batches, fp32 and
bf16, grouped-query and multi-head attention; greedy rollouts with the KV cache. In-process: the
mask handling, the flag, and the planner (no ``s x s`` term; ``--validate`` on the CPU).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import REPO, result, run_workers
from logra_megatron.errors import UserError
from logra_megatron.models.build import causal_attention_mask
from logra_megatron.models.config import get_preset, resolve_attention_backend
from logra_megatron.models.positions import padded_causal_mask
from logra_megatron.models.sdpa_attention import derived_mask, mask_bias
from logra_megatron.planning.activations import activation_bytes, global_buffer_bytes
from logra_megatron.planning.settings import PlanSettings

TOLERANCES = {  # SDPA keeps the softmax in fp32 and never rounds the scores to bf16; unfused does
    "fp32": {"logits_max_abs": 1e-5, "grad_max_rel": 1e-5},
    "bf16": {"logits_rel": 2e-2, "grad_max_rel": 3e-2},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("sdpa_checks.py", 2, tmp_path_factory.mktemp("sdpa"))


@pytest.mark.parametrize("dtype", tuple(TOLERANCES))
@pytest.mark.parametrize("model", ("gqa", "mha"))
@pytest.mark.parametrize("tp", (1, 2))
def test_sdpa_matches_unfused_logits_and_gradients(results, tp, model, dtype):
    for rank in (0, 1):
        report = result(results, f"tp{tp}/{model}/{dtype}", rank)
        for kind in ("causal", "padded"):
            check = report[kind]
            assert check["finite"], (kind, check)  # the padding queries attend to no key
            for key, bound in TOLERANCES[dtype].items():
                assert check[key] < bound, (rank, kind, key, check)


@pytest.mark.parametrize("model", ("gqa", "mha"))
@pytest.mark.parametrize("tp", (1, 2))
def test_greedy_rollouts_with_the_kv_cache_are_token_identical(results, tp, model):
    for rank in (0, 1):
        completions = result(results, f"tp{tp}/{model}/greedy", rank)
        assert completions["sdpa"] == completions["unfused"], rank
        assert len({len(row) for row in completions["sdpa"]}) == 1 and len(completions["sdpa"][0]) == 8


# --- masks ---------------------------------------------------------------------------------------

def test_the_causal_mask_runs_as_is_causal_and_others_as_a_bias():
    real = torch.ones(2, 6, dtype=torch.bool)
    assert derived_mask(causal_attention_mask(6)).causal
    assert derived_mask(padded_causal_mask(real)).causal  # a padded batch without padding
    real[1, :2] = False
    assert not derived_mask(padded_causal_mask(real)).causal
    assert not derived_mask(~real[:, None, None, :]).causal  # a KV-cache decode step's pad-key mask


def test_fully_masked_rows_stay_finite_and_uniform():
    real = torch.ones(1, 5, dtype=torch.bool)
    real[0, :2] = False
    mask = padded_causal_mask(real)  # the first two queries see no real key
    bias = mask_bias(mask, torch.float32)
    assert torch.isfinite(bias).all()
    assert bool((bias[0, 0, 0] == torch.finfo(torch.float32).min).all())
    values = torch.randn(1, 1, 5, 3)
    scores = torch.randn(1, 1, 5, 5)
    out = torch.softmax(scores + bias, dim=-1) @ values
    assert torch.allclose(out[0, 0, 0], values[0, 0].mean(0))  # the unfused path's uniform average


def test_the_remembered_bias_follows_an_in_place_change():
    mask = causal_attention_mask(4).clone()
    first = mask_bias(mask, torch.float32)
    assert mask_bias(mask, torch.float32) is first  # every layer of a forward shares it
    mask[..., 0, 1] = False
    assert not derived_mask(mask).causal
    assert mask_bias(mask, torch.float32)[0, 0, 0, 1] == 0


def test_unknown_backends_are_one_error():
    assert resolve_attention_backend("auto") == "sdpa"
    with pytest.raises(UserError, match=r"unknown attention backend 'flash' \(--attention-backend\); known: auto, sdpa, unfused"):
        resolve_attention_backend("flash")
    with pytest.raises(UserError, match="--attention-backend"):
        activation_bytes(PlanSettings(model=get_preset("tiny"), attention_backend="fused"), 0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--attention-backend", "flash"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode != 0
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        line for line in proc.stderr.splitlines() if "error:" in line and "--attention-backend" in line]


# --- the planner ---------------------------------------------------------------------------------

def _peaks(backend: str, platform: str, lengths=(2048, 4096, 8192)):
    return [activation_bytes(PlanSettings(model=get_preset("qwen2.5-0.5b"), optimizer="adam", kl_control="off",
                                          bf16=True, micro_batch_size=1, global_batch_size=1, seq_length=length,
                                          attention_backend=backend), 0, platform)["forward_backward_peak_bytes"]
            for length in lengths]


@pytest.mark.parametrize("platform", ("cuda", "cpu"))
def test_the_sdpa_plan_has_no_seq_by_seq_term(platform):
    sdpa, unfused = _peaks("sdpa", platform), _peaks("unfused", platform)
    for shorter, longer in zip(sdpa, sdpa[1:]):
        assert longer / shorter < 2.05  # linear in the sequence length
    for shorter, longer in zip(unfused, unfused[1:]):
        assert longer / shorter > 3.0  # the b x heads x s x s scores
    assert all(a < b for a, b in zip(sdpa, unfused))
    settings = PlanSettings(model=get_preset("qwen2.5-0.5b"), seq_length=8192)
    assert global_buffer_bytes(settings) == 0
    assert global_buffer_bytes(settings.with_changes(attention_backend="unfused")) > 0


def test_the_sdpa_plan_validates_on_the_cpu():
    """A step where attention dominates (255 tokens of tiny, 4 rows): the plan of SDPA's kernel
    against the CPU tracker, within --validate's bounds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--attention-backend", "sdpa", "--bf16",
               "--optimizer", "adam", "--kl-control", "off", "--micro-batch-size", "4", "--global-batch-size", "4",
               "--seq-length", "255", "--validate", "--steps", "1", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = report["ranks"][0]["peak_step"]
    assert proc.returncode == 0 and report["all_within_bounds"], peak
    assert abs(peak["error"]) <= 0.05, peak
