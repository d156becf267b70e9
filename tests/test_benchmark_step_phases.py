"""tools/benchmark_step_phases.py on tiny, 2 timed steps: both optimizers' step times and every
phase each of them runs, in one JSON object."""

import json
import os
import subprocess
import sys

from dist_harness import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
DENSE_PHASES = {"zero_grad", "forward_backward", "optimizer_step", "grad_norm", "dense_step"}
LOGRA_PHASES = DENSE_PHASES | {"sketch_reduce", "update_rule", "kl_forecast", "kl_realized", "commit", "range_finder",
                               "norm_probe_draw", "range_finder_arm"}


def test_the_phases_of_both_optimizers_in_one_json_object():
    proc = subprocess.run(
        [sys.executable, "tools/benchmark_step_phases.py", "--preset", "tiny", "--bf16", "--logra-master", "bf16-sr",
         "--logra-rank", "8", "--logra-embeddings", "--steps", "2", "--seq-length", "16", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--kl-realized-interval", "1", "--json"],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["settings"]["refresh_interval"] == 2 and report["settings"]["device"] == "cpu"
    for side, expected in (("dense", DENSE_PHASES), ("logra", LOGRA_PHASES)):
        result = report[side]
        phases = result["phases_s"]
        assert expected <= set(phases), (side, sorted(phases))
        assert all(phases[name] > 0 for name in expected), (side, phases)
        assert result["timed_steps"] == 2 and result["step_time_s"] > 0
        assert set(result["cpu"]["phases_s"]) == set(phases) and result["cpu"]["step_time_s"] > 0
        assert result["step_time_s"] >= phases["forward_backward"]
        for step in result["steps"]:
            seconds = step["seconds"]
            inner = sum(seconds.get(name, 0.0) for name in expected - {"zero_grad", "forward_backward",
                                                                      "optimizer_step", "norm_probe_draw",
                                                                      "range_finder_arm"})
            assert inner <= seconds["optimizer_step"] + 1e-6
            assert seconds["zero_grad"] + seconds["forward_backward"] + seconds["optimizer_step"] <= seconds["step"] + 1e-6
    assert "kl_forecast" not in report["dense"]["phases_s"] and "commit" not in report["dense"]["phases_s"]
    logra = report["logra"]
    # The forecast's and the realized KL's parts: the preview, the probe's forward passes, the KL.
    for step in logra["steps"]:
        seconds = step["seconds"]
        parts = [seconds[name] for name in ("kl_preview", "kl_probe_forward", "kl_divergence")]
        assert all(value > 0 for value in parts), seconds
        assert sum(parts) <= seconds["kl_forecast"] + seconds["kl_realized"] + 1e-6
    assert logra["refresh_steps"] == 1 and logra["refresh_step_time_s"] > logra["phases_s"]["range_finder"]
    assert logra["step_time_without_kl_s"] < logra["step_time_s"]
    assert set(report["ratio"]) >= {"step_time_s", "step_time_without_kl_s", "amortized_step_time_s", "cpu"}
    # The controller's share: forecast (with its refinements) + realized KL over the step that did
    # not refresh (the first timed one).
    plain = logra["steps"][0]["seconds"]
    share = (plain["kl_forecast"] + plain["kl_realized"]) / plain["step"]
    assert report["controller_share"] == logra["controller_share"] == share and 0 < share < 1
    assert abs(logra["step_time_without_kl_s"] - (plain["step"] - plain["kl_forecast"] - plain["kl_realized"])) < 1e-9
    assert report["settings"]["kl_realized_interval"] == 1
    assert "controller_share" in proc.stderr


def test_bad_input_is_one_error_line():
    proc = subprocess.run([sys.executable, "tools/benchmark_step_phases.py", "--logra-master", "bf16-sr"],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --logra-master bf16-sr needs --bf16"


def test_data_parallel_reports_the_sketch_reduction_blocking_and_overlapped():
    """--data-parallel 2 (gloo, 2 ranks per side), 1 step on tiny: LoGRA's sketch reduction blocking
    beside overlapped with the backward, with the same bytes at the collectives; the overlapped one
    in several buckets that the backward started, the blocking one in one call after it."""
    proc = subprocess.run(
        [sys.executable, "tools/benchmark_step_phases.py", "--preset", "tiny", "--data-parallel", "2",
         "--ddp-bucket-size", "2000", "--logra-rank", "8", "--steps", "1", "--seq-length", "16",
         "--global-batch-size", "4", "--micro-batch-size", "2", "--kl-control", "off", "--json"],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["settings"]["data_parallel"] == 2 and report["settings"]["ddp_bucket_size"] == 2000
    assert {"dense", "logra", "ratio", "controller_share"} <= set(report)
    assert report["logra"]["overlap_grad_reduce"] is False and report["logra_overlapped"]["overlap_grad_reduce"]
    reduction = report["sketch_reduction"]
    blocking, overlapped = reduction["blocking"], reduction["overlapped"]
    for mode in (blocking, overlapped):
        assert mode["step_time_s"] > 0 and 0 < mode["exposed_reduce_s"] < mode["step_time_s"]
        assert len(mode["exposed_reduce_per_rank_s"]) == 2 and all(t > 0 for t in mode["exposed_reduce_per_rank_s"])
        assert mode["cpu"]["step_time_s"] > 0 and mode["cpu"]["exposed_reduce_s"] >= 0
    assert blocking["sketch_collective_bytes"] > 0
    assert blocking["sketch_collective_bytes"] == overlapped["sketch_collective_bytes"]
    assert reduction["collective_bytes_equal"] is True
    assert blocking["sketch_collectives"] == blocking["sketch_buckets"] == 1
    assert blocking["sketch_buckets_started_in_backward"] == 0
    assert overlapped["sketch_collectives"] == overlapped["sketch_buckets"] > 1
    assert overlapped["sketch_buckets_started_in_backward"] == overlapped["sketch_buckets"]


def test_data_parallel_must_divide_the_batch():
    proc = subprocess.run([sys.executable, "tools/benchmark_step_phases.py", "--data-parallel", "3"],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --global-batch-size must be a multiple of --micro-batch-size x --data-parallel"
