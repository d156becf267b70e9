"""tools/benchmark_optimizer.py's rows (the planner's: adam, adam-precision-aware, adam-cpu-offload,
adam-8bit, adam-kl, logra) in one run on the tiny model: every row listed under the same keys,
the rows that run here measured byte for byte against counts made by hand, the rows that cannot
run on a CPU listed with their reason; and the GPU check's ``baselines`` stage built, parsed and
skipped without CUDA."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")
ARGS = ["--preset", "tiny", "--logra-rank", "8", "--steps", "1", "--seq-length", "16", "--bf16",
        "--kl-control", "probe"]


def _load(name):
    sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run():
    proc = subprocess.run([sys.executable, "tools/benchmark_optimizer.py", *ARGS, "--json"],
                          capture_output=True, text=True, timeout=1800, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout)


def test_the_rows_are_the_planners():
    from logra_megatron.planning.settings import ROWS

    assert _load("benchmark_optimizer").ROWS == ROWS


def test_every_row_is_listed_under_stable_keys(run):
    bench = _load("benchmark_optimizer")
    _, report = run
    rows = report["rows"]
    assert list(rows) == list(bench.ROWS)
    for name, row in rows.items():
        assert tuple(row) == bench.ROW_KEYS, name
        assert tuple(row["planned"]) == bench.PLANNED_KEYS, name
        assert row["row"] == name and row["status"] in ("measured", "unavailable")
        figures = [row[key] for key in bench.METRICS + bench.EXTRA_METRICS if key != "cuda_max_memory_allocated_bytes"]
        if row["status"] == "measured":
            assert row["reason"] is None and None not in figures, name
            assert row["training_state_bytes"] == sum(row[key] for key in bench.COMPONENTS)
            assert row["peak_step_bytes"] > 0 and row["host_peak_rss_bytes"] >= row["host_rss_bytes"] > 10_000_000
            assert math.isfinite(row["final_loss"]) and row["step_time_s"] > 0
        else:
            assert row["reason"] and all(value is None for value in figures), name
        assert row["planned"]["training_state_bytes"] > 0
    for side, name in (("dense", "adam"), ("logra", "logra")):
        assert report[side] == {key: rows[name][key] for key in bench.SIDE_KEYS}
    assert set(report["ratio"]) == set(bench.METRICS) and set(report["ratio_to_adam"]) == set(rows)
    assert report["ratio_to_adam"]["adam"]["training_state_bytes"] == 1.0
    # Where they run: the controller and 8-bit Adam on the CPU; precision-aware Adam needs
    # Transformer Engine, CPU offload needs CUDA (each says so).
    for name in ("adam", "adam-kl", "logra"):
        assert rows[name]["status"] == "measured", rows[name]["reason"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert rows["adam-8bit"]["status"] == "measured", rows["adam-8bit"]["reason"]
    else:
        assert "pip install bitsandbytes" in rows["adam-8bit"]["reason"]
    if not torch.cuda.is_available():
        assert rows["adam-precision-aware"]["status"] == "unavailable"
        assert "Transformer Engine" in rows["adam-precision-aware"]["reason"]
        assert rows["adam-cpu-offload"]["status"] == "unavailable"
        assert "HybridDeviceOptimizer" in rows["adam-cpu-offload"]["reason"]
        assert "here: its first step raised KeyError" in rows["adam-cpu-offload"]["reason"]
        # The offload's planned bytes still say where its state would be: all of it on the host.
        offload = rows["adam-cpu-offload"]["planned"]
        assert offload["master_bytes"] == offload["moment_bytes"] == 0 and offload["host_state_bytes"] > 0


def _dense_by_hand(numels):
    """Megatron's dense Adam in bf16 on one rank: bf16 weights, DDP's fp32 gradient buffer, fp32
    masters, two fp32 moments and torch's 4-byte step per tensor."""
    total = sum(numels)
    return {"weight_bytes": 2 * total, "grad_bytes": 4 * total, "master_bytes": 4 * total,
            "moment_bytes": 8 * total + 4 * len(numels), "sketch_bytes": 0, "projection_bytes": 0}


def test_dense_rows_hold_the_bytes_counted_by_hand(run):
    _, report = run
    rows = report["rows"]
    numels = rows["adam"]["main_tensor_numels"]
    # The tiny llama: 4 layers x (2 norms, qkv, proj, fc1, fc2) + embedding, final norm, output layer.
    assert len(numels) == 4 * 6 + 3 and sum(numels) == 256 * 64 * 2 + 64 + 4 * (
        2 * 64 + 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    adam = _dense_by_hand(numels)
    assert {key: rows["adam"][key] for key in adam} == adam
    assert rows["adam"]["controller_extra_bytes"] == 0
    # Under the KL controller: the same state, plus fp32 copies of every main before and after the step.
    assert rows["adam-kl"]["main_tensor_numels"] == numels
    assert {key: rows["adam-kl"][key] for key in adam} == adam
    assert rows["adam-kl"]["controller_extra_bytes"] == 2 * 4 * sum(numels)
    # The planner agrees with both byte for byte.
    for name in ("adam", "adam-kl"):
        for key in list(adam) + ["controller_extra_bytes", "training_state_bytes"]:
            assert rows[name]["planned"][key] == rows[name][key], (name, key)


def test_8bit_adam_holds_the_bytes_counted_by_hand(run):
    _, report = run
    row = report["rows"]["adam-8bit"]
    if row["status"] != "measured":
        pytest.fail(f"adam-8bit did not run here: {row['reason']}")
    numels = row["main_tensor_numels"]
    # bitsandbytes' AdamW8bit: tensors under 4096 elements keep two fp32 moments; the others one
    # byte per element and moment plus an fp32 absmax per block of 256; its step is a Python int,
    # and its two 256-entry fp32 quantization maps are shared by every parameter (stored once).
    by_hand = sum(8 * n if n < 4096 else 2 * n + 2 * 4 * math.ceil(n / 256) for n in numels) + 2 * 256 * 4
    assert row["moment_bytes"] == by_hand
    dense = _dense_by_hand(numels)
    assert {key: row[key] for key in ("weight_bytes", "grad_bytes", "master_bytes")} == {
        key: dense[key] for key in ("weight_bytes", "grad_bytes", "master_bytes")}
    # The planner counts a 4-byte step per tensor and not the shared maps.
    assert row["planned"]["moment_bytes"] - row["moment_bytes"] == 4 * len(numels) - 2 * 256 * 4
    assert row["moment_bytes"] < 0.3 * report["rows"]["adam"]["moment_bytes"]


def test_logra_row_is_the_planners(run):
    _, report = run
    logra = report["rows"]["logra"]
    for key in ("weight_bytes", "grad_bytes", "master_bytes", "sketch_bytes", "projection_bytes", "moment_bytes",
                "controller_extra_bytes", "training_state_bytes"):
        assert logra[key] == logra["planned"][key], key
    assert logra["training_state_bytes"] < report["rows"]["adam"]["training_state_bytes"]


def test_the_gpu_stage_command_and_its_report(run):
    tool = _load("gpu_check")
    bench = _load("benchmark_optimizer")
    sizes = ["--seq-length", "512", "--global-batch-size", "8", "--micro-batch-size", "2"]
    command = tool.baseline_command("python", False, sizes)
    assert command[:2] == ["python", str(REPO / "tools" / "benchmark_optimizer.py")]
    args = bench.parse_args(command[2:])  # every flag it passes is the benchmark's
    assert (args.preset, args.bf16, args.json, args.overlap_cpu_optimizer_d2h_h2d) == ("qwen2.5-1.5b", True, True, True)
    assert bench.selected_rows(args) == ["adam-precision-aware", "adam-cpu-offload", "logra"]
    assert bench.parse_args(tool.baseline_command("python", True, sizes)[2:]).preset == "tiny"
    stage = {stage.name: stage for stage in tool.stages(False, REPO, "python")}["baselines"]
    assert stage.needs_cuda and stage.command == command
    stdout, report = run
    figures = stage.figures("a library's log line\n" + stdout)
    assert list(figures) == list(tool.BASELINE_ROWS)
    for name, entry in figures.items():
        row = report["rows"][name]
        assert entry["status"] == row["status"] and entry["step_time_s"] == row["step_time_s"]
        assert entry["host_peak_rss_bytes"] == row["host_peak_rss_bytes"]
        assert entry["planned_host_state_bytes"] == row["planned"]["host_state_bytes"]
    assert stage.passed(figures) is None
    assert stage.passed({**figures, "logra": {**figures["logra"], "status": "unavailable"}}) == "the LoGRA row did not run"
    with pytest.raises(ValueError, match="no row adam-cpu-offload"):
        stage.figures(json.dumps({"rows": {k: v for k, v in report["rows"].items() if k != "adam-cpu-offload"}}))


def test_the_gpu_stage_is_skipped_without_cuda(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu", "--stages", "baselines", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stages"] == {"baselines": {"status": "skipped", "seconds": 0,
                                              "reason": "needs CUDA (run on a GPU without --cpu)"}}
    assert "| baselines | skipped |" in (tmp_path / "report.md").read_text()
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--stages", "baselines", str(tmp_path)],
                              capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error: no CUDA device here")


@pytest.mark.parametrize("args,message", [
    (["--rows", "adam,sgd"], "--rows must name rows of adam, adam-precision-aware"),
    (["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction must be in [0, 1]"),
])
def test_bad_row_flags_are_one_line(args, message):
    proc = subprocess.run([sys.executable, "tools/benchmark_optimizer.py", *args],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr
