"""The GPU check: every stage that needs a GPU to mean something, in one prepared run.

Run by ``launch/gpu_check.sh`` (which makes megatron-core importable first). Each stage is one
command in a process of its own, bounded by a timeout; a failing stage is reported and the run
goes on. ``OUT_DIR`` receives ``report.json`` (``{"stages": {NAME: {"status": "ok" | "failed" |
"skipped", "seconds": ..., figures...}}}``), ``report.md`` (the same as tables) and
``stages.log`` (every stage's output): three files, within what a device run returns.

``--cpu`` runs the same stages on the ``tiny`` preset on the CPU, at sizes that take a few
minutes on 2 cores (CI runs this mode); on a GPU the stages use ``smollm2-135m``,
``qwen2.5-1.5b`` and, for ``big``, the largest preset the planner fits on the device. A stage
marked ``needs_cuda`` (``baselines``: precision-aware Adam and CPU offload, which megatron-core
cannot run without CUDA, beside LoGRA; docs/BASELINES.md) is reported skipped in ``--cpu`` mode.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from _bench_common import last_json_line  # noqa: E402

GIB = 1 << 30

# The single-process test modules that run on CUDA in the test process (multi-rank modules run
# their workers on the CPU on a 1-GPU machine and are CI's business).
SINGLE_PROCESS_TESTS = (
    "tests/test_on_device.py", "tests/test_models_and_layout.py", "tests/test_logra_sketch.py",
    "tests/test_logra_bf16.py", "tests/test_logra_embeddings.py", "tests/test_logra_training.py",
    "tests/test_logra_memory.py", "tests/test_kl_control.py", "tests/test_optimizer_protocol.py",
    "tests/rl/test_rl_losses.py", "tests/rl/test_rl_advantages.py", "tests/test_rollout.py",
)


@dataclass
class Stage:
    name: str
    command: List[str]
    timeout_s: int
    figures: Callable[[str], dict] = lambda output: {}
    """Figures read from the stage's stdout; raising marks the stage failed."""
    passed: Callable[[dict], Optional[str]] = lambda figures: None
    """A reason to fail a stage that exited 0 (None: it passed)."""
    env: dict = field(default_factory=dict)
    needs_cuda: bool = False
    """Run only on a GPU: in ``--cpu`` mode it is reported skipped (its rows cannot run there)."""


# --- what each stage reports --------------------------------------------------------------------

def last_json(output: str) -> dict:
    """The last line of ``output`` that parses as a JSON object."""
    report = last_json_line(output)
    if report is None:
        raise ValueError("the stage printed no JSON object")
    return report


def pytest_figures(output: str) -> dict:
    """Counts from pytest's closing line."""
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)}
    if not counts:
        raise ValueError("no pytest summary line")
    return counts


def benchmark_figures(output: str) -> dict:
    report = last_json(output)
    figures = {}
    for side in ("dense", "logra"):
        figures[side] = {key: value for key, value in report[side].items() if isinstance(value, (int, float))}
    figures["logra_over_dense"] = report.get("ratio", {})
    return figures


BASELINE_ROWS = ("adam-precision-aware", "adam-cpu-offload", "logra")
"""The ``baselines`` stage's rows (``tools/benchmark_optimizer.py --rows``): the dense baselines a
Megatron user short of memory turns on, beside LoGRA."""
BASELINE_FIGURES = ("status", "reason", "cuda_max_memory_allocated_bytes", "peak_step_bytes", "host_rss_bytes",
                    "host_peak_rss_bytes", "offloaded_state_bytes", "step_time_s", "training_state_bytes")


def baseline_command(python: str, cpu: bool, sizes: List[str]) -> List[str]:
    """The ``baselines`` stage: precision-aware Adam, CPU offload (with Megatron's copy overlap, as
    slime's recipe runs it) and LoGRA on ``qwen2.5-1.5b`` in bf16 (``tiny`` with ``--cpu``), one
    process per row."""
    return [python, str(REPO / "tools" / "benchmark_optimizer.py"), "--preset", "tiny" if cpu else "qwen2.5-1.5b",
            "--bf16", "--rows", ",".join(BASELINE_ROWS), "--overlap-cpu-optimizer-d2h-h2d",
            "--logra-master", "bf16-sr", "--logra-embeddings", "--kl-control", "probe", "--steps", "2", *sizes, "--json"]


def baseline_figures(output: str) -> dict:
    """Per row, side by side: CUDA's peak, host RSS, step time, the state measured and the
    planner's (GPU and host), and why a row could not run."""
    rows = last_json(output)["rows"]
    missing = [row for row in BASELINE_ROWS if row not in rows]
    if missing:
        raise ValueError(f"no row {', '.join(missing)} in the benchmark's report")
    return {row: {**{key: rows[row][key] for key in BASELINE_FIGURES},
                  "planned_training_state_bytes": rows[row]["planned"]["training_state_bytes"],
                  "planned_host_state_bytes": rows[row]["planned"]["host_state_bytes"]}
            for row in BASELINE_ROWS}


def baseline_passed(figures: dict) -> Optional[str]:
    """LoGRA must run; a baseline that cannot (no Transformer Engine for precision-aware Adam) is a
    finding its row's reason records, not a failure."""
    return None if figures["logra"]["status"] == "measured" else "the LoGRA row did not run"


def validate_figures(output: str) -> dict:
    report = last_json(output)
    rows = report.get("validation", report.get("ranks", []))
    if isinstance(rows, dict):
        rows = list(rows.values())
    return {"within_bounds": [row.get("within_bounds") for row in rows if isinstance(row, dict)],
            "peak_step": [{"optimizer": row.get("optimizer"), **row.get("peak_step", {})}
                          for row in rows if isinstance(row, dict) and "peak_step" in row]}


def validate_passed(figures: dict) -> Optional[str]:
    bounds = figures["within_bounds"]
    if not bounds:
        return "no validation rows"
    return None if all(bounds) else "a measured component or step peak is outside the planner's bounds"


def rl_figures(output: str) -> dict:
    figures = {}
    for label, key in (("initial", "accuracy_initial"), ("start of RL", "accuracy_start_of_rl"),
                       ("after RL", "accuracy_after_rl")):
        match = re.search(rf"held-out accuracy \({label}\): ([0-9.]+)%", output)
        if match:
            figures[key] = float(match.group(1))
    summary = re.search(r"summary: (\S+summary\.json)", output)
    if summary is None:
        raise ValueError("the trainer printed no summary path")
    data = json.loads(Path(summary.group(1)).read_text())
    figures["summary"] = {key: data[key] for key in ("steps", "wall_time_s", "step_time_s", "platform",
                                                      "memory_plan") if key in data}
    return figures


def rl_passed(figures: dict) -> Optional[str]:
    return None if "accuracy_after_rl" in figures else "no held-out accuracy after RL"


def big_passed(figures: dict) -> Optional[str]:
    return None if figures.get("success") else "a step did not commit"


def build_passed(figures: dict) -> Optional[str]:
    return None if figures["build_s"] < 30 else f"built in {figures['build_s']:.1f} s (the aim: under 30 s)"


def packing_passed(figures: dict, cpu: bool) -> Optional[str]:
    if not figures["engine"]["identical"]["greedy"]:
        return "greedy completions differ packed and padded"
    if not cpu and figures["packed"]["flash_varlen_calls"] == 0:
        return "the packed attention did not run on the varlen flash kernel (the per-sequence loop instead)"
    return None


def phases_figures(output: str) -> dict:
    return last_json(output)


# --- the stages ---------------------------------------------------------------------------------

def stages(cpu: bool, scratch: Path, python: str) -> List[Stage]:
    """The stages in the order they run (the most telling first: a run cut short by its budget
    still has them). ``scratch`` takes the files stages write (outside OUT_DIR, whose file count
    a device run limits)."""
    tools = str(REPO / "tools")
    presets = ("tiny",) if cpu else ("smollm2-135m", "qwen2.5-1.5b")
    smoke_preset = "tiny" if cpu else "smollm2-135m"
    speed_preset = "tiny" if cpu else "qwen2.5-1.5b"
    sizes = ["--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size", "2"] if cpu else \
        ["--seq-length", "512", "--global-batch-size", "8", "--micro-batch-size", "2"]
    result: List[Stage] = [
        Stage("pytest_gpu_marked", [python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
              240, pytest_figures),
        *(Stage(f"smoke_{optimizer}",
                [python, "-m", "logra_megatron.smoke", "--preset", smoke_preset, "--optimizer", optimizer,
                 "--train-iters", "3", "--report-json", str(scratch / f"smoke_{optimizer}.json")],
                120, lambda output, optimizer=optimizer: json.loads((scratch / f"smoke_{optimizer}.json").read_text()))
          for optimizer in ("adam", "logra")),
        Stage("big", [python, f"{tools}/single_gpu_rl_step.py", "--json",
                      *(["--preset", "tiny", "--seq-length", "64", "--rollout-max-tokens", "8"] if cpu else [])],
              300, last_json, big_passed),
        Stage("build_7b", [python, f"{tools}/single_gpu_rl_step.py", "--steps", "0", "--json",
                           "--preset", "tiny" if cpu else "qwen2.5-7b"], 120, last_json, build_passed),
        Stage("speed", [python, f"{tools}/benchmark_step_phases.py", "--preset", speed_preset, "--bf16",
                        "--logra-master", "bf16-sr", "--logra-embeddings", "--kl-control", "probe", "--steps", "2",
                        *sizes, "--json"], 240, phases_figures),
        Stage("baselines", baseline_command(python, cpu, sizes), 300, baseline_figures, baseline_passed,
              needs_cuda=True),
        # One GRPO step on a ragged batch, padded vs packed; bf16, so on CUDA the packed attention is
        # the varlen flash kernel (packing_passed fails the stage where it fell back to the loop).
        Stage("packing", [python, f"{tools}/benchmark_packing.py", "--preset", smoke_preset, "--bf16", "--json",
                          *(["--rows", "8", "--repeats", "1", "--engine-prompts", "4", "--engine-samples", "2",
                             "--engine-new-tokens", "4"] if cpu else [])],
              240, last_json, lambda figures, cpu=cpu: packing_passed(figures, cpu)),
    ]
    for preset in presets:
        for master in ("fp32", "bf16-sr"):
            result.append(Stage(
                f"benchmark_{preset}_{master}",
                [python, f"{tools}/benchmark_optimizer.py", "--preset", preset, "--bf16", "--kl-control", "probe",
                 "--logra-embeddings", "--logra-master", master, "--steps", "2", *sizes, "--json"],
                180, benchmark_figures))
    for preset in presets:
        result.append(Stage(
            f"plan_validate_{preset}",
            [python, f"{tools}/plan_memory.py", "--preset", preset, "--bf16", "--logra-master", "bf16-sr",
             "--logra-embeddings", "--kl-control", "probe", *sizes, "--validate", "--json"],
            240, validate_figures, validate_passed))
    result.append(Stage(
        "rl_20_steps",
        [python, "-m", "logra_megatron.train", "--train-iters", "20", "--no-progress",
         *(["--warmup-iters", "5", "--eval-prompts", "16"] if cpu else []),
         "--output-dir", str(scratch / "runs")], 300, rl_figures, rl_passed))
    tests = ("tests/test_on_device.py",) if cpu else SINGLE_PROCESS_TESTS
    result.append(Stage("pytest_single_process",
                        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests],
                        420, pytest_figures))
    return result


def run_stage(stage: Stage, env: dict, log) -> dict:
    start = time.perf_counter()
    log.write(f"\n===== {stage.name}: {' '.join(stage.command)}\n")
    log.flush()
    try:
        proc = subprocess.run(stage.command, cwd=REPO, env={**env, **stage.env}, capture_output=True, text=True,
                              timeout=stage.timeout_s)
        output, code = proc.stdout, proc.returncode
        log.write(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"") + (expired.stderr or b"")
        log.write(text.decode(errors="replace") if isinstance(text, bytes) else text)
        return {"status": "failed", "seconds": round(time.perf_counter() - start, 1),
                "reason": f"timed out after {stage.timeout_s} s"}
    entry = {"status": "ok", "seconds": round(time.perf_counter() - start, 1)}
    if code != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
        return {**entry, "status": "failed", "reason": f"exit code {code}: {tail[0][:300]}"}
    try:
        figures = stage.figures(output)
    except Exception as error:  # a stage that ran but reported nothing readable
        return {**entry, "status": "failed", "reason": f"unreadable output: {error}"}
    reason = stage.passed(figures)
    if reason:
        entry.update(status="failed", reason=reason)
    entry.update(figures)
    return entry


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['mode']}): {report['device']}", "",
             f"{report['ok']} ok, {report['failed']} failed, {report['skipped']} skipped in {report['seconds']:.0f} s", "",
             "| stage | status | seconds | figures |", "| --- | --- | ---: | --- |"]
    for name, entry in report["stages"].items():
        figures = {key: value for key, value in entry.items() if key not in ("status", "seconds")}
        text = json.dumps(figures, default=str)
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', 0)} | {text[:600]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--cpu", action="store_true", help="the same stages on tiny, on the CPU")
    parser.add_argument("--stages", default=None, help="comma-separated stage names (default: all)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new stages after this many seconds (they are reported skipped); "
                             "default 450 on a GPU (a device run's 8 minutes less start-up), none with --cpu")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if args.cpu:
        env["LOGRA_FORCE_CPU"] = "1"
    import torch  # after the flags: a bad flag fails fast

    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --cpu for the CPU mode", file=sys.stderr)
        sys.exit(2)
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.cpu else 450.0)
    planned = stages(args.cpu, Path(tempfile.mkdtemp(prefix="gpu_check_")), sys.executable)
    wanted = None if args.stages is None else set(args.stages.split(","))
    if wanted is not None and wanted - {stage.name for stage in planned}:
        print(f"error: unknown stage(s) {sorted(wanted - {s.name for s in planned})}; "
              f"known: {', '.join(s.name for s in planned)}", file=sys.stderr)
        sys.exit(2)
    report = {"mode": "cpu" if args.cpu else "gpu", "device": device, "torch": torch.__version__, "stages": {}}
    start = time.perf_counter()
    with open(out_dir / "stages.log", "w") as log:
        for stage in planned:
            if wanted is not None and stage.name not in wanted:
                continue
            if stage.needs_cuda and args.cpu:
                report["stages"][stage.name] = {"status": "skipped", "seconds": 0,
                                                "reason": "needs CUDA (run on a GPU without --cpu)"}
            elif time.perf_counter() - start > budget:
                report["stages"][stage.name] = {"status": "skipped", "seconds": 0, "reason": "time budget spent"}
            else:
                print(f"[gpu_check] {stage.name} ...", flush=True)
                report["stages"][stage.name] = run_stage(stage, env, log)
                entry = report["stages"][stage.name]
                print(f"[gpu_check] {stage.name}: {entry['status']} in {entry['seconds']} s"
                      + (f" ({entry['reason']})" if "reason" in entry else ""), flush=True)
            # Written after every stage: a run cut short still leaves its report.
            statuses = [entry["status"] for entry in report["stages"].values()]
            report.update(ok=statuses.count("ok"), failed=statuses.count("failed"),
                          skipped=statuses.count("skipped"), seconds=time.perf_counter() - start)
            (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
            (out_dir / "report.md").write_text(markdown(report))
    print(f"[gpu_check] {report['ok']} ok, {report['failed']} failed, {report['skipped']} skipped: "
          f"{out_dir / 'report.md'}")
    sys.exit(0 if report["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
