"""launch/gpu_check.sh: its --cpu mode runs every stage of the GPU check on the tiny preset and
each reports ok (the same code a GPU run takes, at CPU sizes); the report's shape; a failing
stage is reported and the run goes on."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out_dir, *args, timeout=1500):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(REPO / "launch" / "gpu_check.sh"), "--cpu", *args, str(out_dir)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run(out)
    return proc, out


def test_every_stage_reports_ok_in_cpu_mode(cpu_report):
    proc, out = cpu_report
    report = json.loads((out / "report.json").read_text())
    statuses = {name: entry["status"] for name, entry in report["stages"].items()}
    cuda_only = {stage.name for stage in _load_tool().stages(True, out, sys.executable) if stage.needs_cuda}
    assert cuda_only == {"baselines"} and all(statuses[name] == "skipped" for name in cuda_only)
    failed = {name: entry.get("reason") for name, entry in report["stages"].items()
              if entry["status"] != "ok" and name not in cuda_only}
    assert not failed, (failed, proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = {stage.name for stage in _load_tool().stages(True, out, sys.executable)}
    assert set(statuses) == expected
    assert {"pytest_gpu_marked", "smoke_adam", "smoke_logra", "big", "build_7b", "speed", "rl_20_steps",
            "pytest_single_process"} <= expected
    assert sorted(path.name for path in out.iterdir()) == ["report.json", "report.md", "stages.log"]


def test_cpu_report_holds_the_figures(cpu_report):
    _, out = cpu_report
    stages = json.loads((out / "report.json").read_text())["stages"]
    big = stages["big"]
    assert big["preset"] == "tiny" and big["measured_peak_bytes"] > 0 and big["planned_logra_bytes"] > 0
    assert big["success"] and len(big["step_s"]) == 2
    for master in ("fp32", "bf16-sr"):
        bench = stages[f"benchmark_tiny_{master}"]
        assert bench["logra"]["training_state_bytes"] < bench["dense"]["training_state_bytes"]
    assert all(stages["plan_validate_tiny"]["within_bounds"])
    assert stages["smoke_logra"]["optimizer"] == "logra"
    assert "accuracy_after_rl" in stages["rl_20_steps"]
    assert stages["pytest_single_process"]["passed"] > 0 and "failed" not in stages["pytest_single_process"]
    packing = stages["packing"]
    assert packing["bf16"] and packing["padded_cells"] > packing["real_tokens"]
    assert packing["packed"]["computed_tokens"] == packing["real_tokens"] and packing["ratio"]["tokens_per_s"] > 0
    assert packing["packed"]["flash_varlen_calls"] == 0  # the kernel is CUDA's: the per-sequence loop here
    markdown = (out / "report.md").read_text()
    assert all(f"| {name} | {'skipped' if name == 'baselines' else 'ok'} |" in markdown for name in stages)


def test_a_failing_stage_is_reported_and_the_run_goes_on(tmp_path):
    tool = _load_tool()
    log = (tmp_path / "log").open("w")
    failing = tool.run_stage(tool.Stage("boom", [sys.executable, "-c", "raise SystemExit(3)"], 30), dict(os.environ), log)
    slow = tool.run_stage(tool.Stage("slow", [sys.executable, "-c", "import time; time.sleep(5)"], 1), dict(os.environ), log)
    silent = tool.run_stage(tool.Stage("silent", [sys.executable, "-c", "print('no json')"], 30, tool.last_json),
                            dict(os.environ), log)
    good = tool.run_stage(tool.Stage("good", [sys.executable, "-c", "print('{\"x\": 1}')"], 30, tool.last_json),
                          dict(os.environ), log)
    assert failing["status"] == "failed" and "exit code 3" in failing["reason"]
    assert slow["status"] == "failed" and "timed out" in slow["reason"]
    assert silent["status"] == "failed" and "unreadable" in silent["reason"]
    assert good == {"status": "ok", "seconds": good["seconds"], "x": 1}


def test_unknown_stage_is_one_error_line(tmp_path):
    proc = _run(tmp_path, "--stages", "nonsense", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown stage(s) ['nonsense']")
    assert len(proc.stderr.strip().splitlines()) == 1
