"""tools/plot_parity.py: the parity table's numbers come from the runs' own files."""

import importlib.util
import json
import os

import pytest

from logra_megatron.rl.evaluation import wilson_interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_parity", os.path.join(ROOT, "tools", "plot_parity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(folder, name, before, after, problems=50, steps=4, finished=True, state=1000):
    path = os.path.join(folder, name)
    os.makedirs(path)
    ci = list(wilson_interval(after / 100, problems))
    summary = {"optimizer": name.split("_")[0], "finished": finished, "wall_time_s": 12.0,
               "held_out_accuracy_before": before, "evaluation_before": {"problems": problems,
                                                                         "greedy_ci95": list(wilson_interval(before / 100, problems))},
               "memory_plan_bytes": {"adam": 5, "logra": 3}}
    if finished:
        summary.update(held_out_accuracy_after=after, evaluation_after={"problems": problems, "greedy_ci95": ci})
    with open(os.path.join(path, "summary.json"), "w") as handle:
        json.dump(summary, handle)
    with open(os.path.join(path, "metrics.jsonl"), "w") as handle:
        handle.write(json.dumps({"phase": "warmup", "step": 0, "loss": 1.0}) + "\n")
        for step in range(steps):
            handle.write(json.dumps({"phase": "rl", "step": step, "reward_mean": 0.1 * step,
                                     "accuracy": 10.0 * step, "state_bytes": state + step}) + "\n")


def test_table_and_json_from_runs(tmp_path, capsys):
    tool = load_tool()
    runs = tmp_path / "runs"
    write_run(runs, "adam_s1", before=20.0, after=40.0)
    write_run(runs, "adam_s2", before=30.0, after=60.0)
    write_run(runs, "logra_s1", before=20.0, after=44.0, state=400)
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    table = capsys.readouterr().out
    assert "| dense Adam | 1 | 20.0" in table and "| LoGRA | 1 | 20.0" in table
    report = json.loads((tmp_path / "out" / "toy_parity.json").read_text())
    adam = report["optimizers"]["adam"]
    # Pooled over seeds: (20 + 30) correct of 100 answers after (40% and 60% of 50).
    assert adam["after"]["accuracy"] == 50.0 and adam["after"]["problems"] == 100
    assert adam["after"]["ci95"] == [round(100 * v, 2) for v in wilson_interval(0.5, 100)]
    assert adam["lift_mean"] == 25.0 and adam["lift_std"] == pytest.approx(7.07, abs=0.01)
    assert report["optimizers"]["logra"]["state_bytes"] == 403  # the largest measured, not the first
    assert report["runs"]["adam"]["1"]["rl_steps"] == 4  # warm-up rows are not RL steps
    assert (tmp_path / "out" / "toy_parity.png").stat().st_size > 10_000


def test_unfinished_run_is_one_error_line(tmp_path, capsys):
    tool = load_tool()
    write_run(tmp_path / "runs", "logra_s3", before=20.0, after=0.0, finished=False)
    with pytest.raises(SystemExit) as stop:
        tool.main(["--runs", str(tmp_path / "runs"), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and "logra_s3" in error and "did not finish" in error and "\n" not in error
