"""State accounting and the optimizer benchmark (one short run of each optimizer)."""

import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.logra.accounting import state_bytes
from logra_megatron.models import get_preset
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable, train_step

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


@pytest.mark.parametrize("kind,embeddings,bf16", [("adam", False, False), ("logra", False, False),
                                                   ("adam", False, True), ("logra", True, True)])
def test_planned_state_bytes_equal_what_the_optimizer_allocates(kind, embeddings, bf16):
    import torch

    model_config = get_preset("tiny")
    logra = LogRAConfig(rank=16, embeddings=embeddings)
    parallel.initialize(1, 1)
    model, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind=kind), logra,
                                            dtype=torch.bfloat16 if bf16 else torch.float32)
    tokens = torch.randint(0, model_config.vocab, (2, 17))
    train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, 2))
    planned = state_bytes(model, logra)["dense" if kind == "adam" else "logra"]
    measured = optimizer.state_bytes()
    assert measured["grad_bytes"] == planned.grad_bytes
    assert measured["projection_bytes"] == planned.projection_bytes
    assert measured["master_weight_bytes"] == planned.master_weight_bytes
    assert (planned.master_weight_bytes > 0) == bf16
    # Adam's moments and its 'step' counter per parameter, as optim/dense_memory.py declares them
    assert measured["optimizer_state_bytes"] == planned.optimizer_state_bytes


def test_logra_state_is_smaller_and_shrinks_with_rank():
    parallel.initialize(1, 1)
    model, _, _ = build_trainable(get_preset("tiny"), OptimizerSettings(kind="adam"))
    small, large = state_bytes(model, LogRAConfig(rank=8)), state_bytes(model, LogRAConfig(rank=32))
    assert small["dense"] == large["dense"]
    assert small["logra"].total < large["logra"].total < large["dense"].total
    # At full rank with the identity, sketches are as large as the gradients (plus projections).
    full = state_bytes(model, LogRAConfig(rank=1.0, identity_projection=True))
    assert full["logra"].grad_bytes == full["dense"].grad_bytes


def test_benchmark_prints_one_json_object_with_both_sides():
    proc = subprocess.run(
        [sys.executable, "tools/benchmark_optimizer.py", "--preset", "tiny", "--logra-rank", "8",
         "--steps", "2", "--seq-length", "16", "--bf16", "--kl-control", "probe", "--logra-embeddings",
         "--json"],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["preset"] == "tiny" and report["rank"] == "8" and report["bf16"] is True
    components = ("weight_bytes", "master_bytes", "grad_bytes", "sketch_bytes", "moment_bytes",
                  "projection_bytes", "controller_extra_bytes")
    for side in ("dense", "logra"):
        assert set(report[side]) == set(components) | {
            "training_state_bytes", "peak_step_bytes", "peak_rss_untracked_bytes", "step_time_s",
            "dp_comm_bytes_per_step", "final_loss", "cuda_max_memory_allocated_bytes"}
        assert report[side]["training_state_bytes"] == sum(report[side][key] for key in components)
        assert report[side]["peak_step_bytes"] > 0 and report[side]["peak_rss_untracked_bytes"] > 10_000_000
    dense, logra = report["dense"], report["logra"]
    # The dense baseline in bf16: weights 2 + grads 4 + masters 4 + moments 8 bytes per parameter.
    params = dense["weight_bytes"] // 2
    assert dense["grad_bytes"] == dense["master_bytes"] == 4 * params
    assert dense["sketch_bytes"] == dense["controller_extra_bytes"] == 0
    assert logra["sketch_bytes"] > 0 and 0 < logra["controller_extra_bytes"] < 0.02 * logra["weight_bytes"]
    assert logra["weight_bytes"] == dense["weight_bytes"]
    assert report["ratio"]["training_state_bytes"] < 0.7
    assert report["ratio"]["moment_bytes"] < 0.5
    assert report["ratio"]["dp_comm_bytes_per_step"] < 0.5


def test_the_peak_figure_is_read_before_the_step_the_profiler_runs(monkeypatch):
    """``peak_rss_untracked_bytes`` (tools/_bench_common.py ``run_steps``) is read after the
    untracked steps and before the tracked one, so nothing the profiled step allocates (nor the
    profiler itself) is in it. The order is what is checked: the RSS high-water mark of a real
    process is at the kernel's mercy under memory pressure (CI saw a 512 MiB step not move it)."""
    sys.path.insert(0, str(REPO / "tools"))
    import _bench_common

    events = []
    monkeypatch.setattr(_bench_common, "peak_process_bytes", lambda: events.append("peak read") or 7)

    def step():
        events.append("tracked step" if len(events) == 3 else "step")
        return 0.0

    *_, untracked = _bench_common.run_steps(step, 3)
    assert untracked == 7
    assert events == ["step", "step", "peak read", "tracked step"]


@pytest.mark.parametrize("args,message", [
    (["--logra-rank", "1000"], "larger than the matrix"),
    (["--logra-max-rank", "-1"], "--logra-max-rank must be an integer >= 0"),
    (["--logra-max-rank", "half"], "invalid int value"),
    (["--logra-refresh-interval", "0"], "must be a positive number of steps"),
    (["--preset", "nope"], "unknown model preset"),
])
def test_benchmark_bad_input_is_one_line(args, message):
    proc = subprocess.run([sys.executable, "tools/benchmark_optimizer.py", *args],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr


def test_declared_master_rows_are_the_rows_the_masters_hold():
    # logra/sketch_memory.py declares a ZeRO-1 master's rows for the planner; logra/masters.py
    # lays the ranges out: the two must agree for every split, uneven ones included
    from logra_megatron.logra.masters import row_ranges
    from logra_megatron.logra.sketch_memory import LEFT, SketchedWeight

    for rows in (1, 5, 48, 49):
        for parts in (1, 2, 3, 8):
            weight = SketchedWeight(LEFT, rows, 7, rank=2)
            assert [weight.master_numel(parts, part) for part in range(parts)] == \
                [(stop - start) * 7 for start, stop in row_ranges(rows, parts)]
