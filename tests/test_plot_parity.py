"""tools/plot_parity.py: the parity table's numbers come from the runs' own files; the paired
difference of lifts, its t interval and the verdict match a hand computation; the learning-rate
search's table and best lr."""

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


def write_run(folder, name, before, after, problems=50, steps=4, finished=True, state=1000, lr=None):
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
            row = {"phase": "rl", "step": step, "reward_mean": 0.1 * step, "accuracy": 10.0 * step,
                   "state_bytes": state + step}
            if lr is not None:  # the peak lr first, then a decay
                row["lr"] = lr * (1 - step / steps)
            handle.write(json.dumps(row) + "\n")


def test_table_and_json_from_runs(tmp_path, capsys):
    tool = load_tool()
    runs = tmp_path / "runs"
    write_run(runs, "adam_s1", before=20.0, after=40.0)
    write_run(runs, "adam_s2", before=30.0, after=60.0)
    write_run(runs, "logra_s1", before=20.0, after=44.0, state=400)
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    table = capsys.readouterr().out
    assert "| dense Adam, no control | 1 | - | 20.0" in table and "| LoGRA | 1 | - | 20.0" in table
    report = json.loads((tmp_path / "out" / "toy_parity.json").read_text())
    adam = report["rows"]["adam"]
    # Pooled over seeds: (20 + 30) correct of 100 answers after (40% and 60% of 50).
    assert adam["after"]["accuracy"] == 50.0 and adam["after"]["problems"] == 100
    assert adam["after"]["ci95"] == [round(100 * v, 2) for v in wilson_interval(0.5, 100)]
    assert adam["lift_mean"] == 25.0 and adam["lift_std"] == pytest.approx(7.07, abs=0.01)
    assert report["rows"]["logra"]["state_bytes"] == 403  # the largest measured, not the first
    assert report["runs"]["adam"]["1"]["rl_steps"] == 4  # warm-up rows are not RL steps
    assert (tmp_path / "out" / "toy_parity.png").stat().st_size > 10_000
    # the per-step curves in a file of their own, one line; the tables' file without them
    curves_text = (tmp_path / "out" / "toy_parity_curves.json").read_text()
    curves = json.loads(curves_text)
    assert "\n" not in curves_text.strip() and "curves" not in report
    assert curves["adam"]["1"]["step"] == [0, 1, 2, 3] and len(curves["adam"]["2"]["reward"]) == 4


def test_unfinished_run_is_one_error_line(tmp_path, capsys):
    tool = load_tool()
    write_run(tmp_path / "runs", "logra_s3", before=20.0, after=0.0, finished=False)
    with pytest.raises(SystemExit) as stop:
        tool.main(["--runs", str(tmp_path / "runs"), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and "logra_s3" in error and "did not finish" in error and "\n" not in error


def lifts(folder, row, values, base=20.0):
    """Runs of ``row`` on seeds 1, 2, ... whose lifts are ``values`` (before: ``base``)."""
    for seed, value in enumerate(values, 1):
        write_run(folder, f"{row}_s{seed}", before=base, after=base + value)


def test_paired_difference_of_lifts_matches_a_hand_computation(tmp_path, capsys):
    tool = load_tool()
    runs = tmp_path / "runs"
    lifts(runs, "logra", [10.0, 14.0, 12.0])
    lifts(runs, "adam-kl", [8.0, 9.0, 13.0])  # differences 2, 5, -1
    lifts(runs, "adam", [4.0, 9.0, 6.0])  # differences 6, 5, 6
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    paired = json.loads((tmp_path / "out" / "toy_parity.json").read_text())["paired"]
    # By hand: mean 2, sd sqrt((0 + 9 + 9) / 2) = 3, t(0.975, 2) = 4.3027, half-width 4.3027 * 3 / sqrt(3) = 7.4524.
    same = paired["logra - adam-kl"]
    assert same["seeds"] == [1, 2, 3] and same["differences"] == [2.0, 5.0, -1.0]
    assert same["mean"] == 2.0 and same["sd"] == pytest.approx(3.0)
    assert same["t"] == pytest.approx(4.3027, abs=1e-4)
    assert same["ci95"] == pytest.approx([2.0 - 7.4524, 2.0 + 7.4524], abs=1e-3)
    assert same["interval"] == "paired t, 2 degrees of freedom, 95%"
    assert same["verdict"] == "inconclusive"  # contains 0, but reaches beyond +-5 points
    # mean 17/3, sd sqrt(1/3), half-width 4.3027 * 0.57735 / sqrt(3) = 1.4342: above 0.
    uncontrolled = paired["logra - adam"]
    assert uncontrolled["ci95"] == pytest.approx([17 / 3 - 1.4342, 17 / 3 + 1.4342], abs=1e-3)
    assert uncontrolled["verdict"] == "leads"
    assert ("| LoGRA - dense Adam, same KL control | lift (points gained in RL) | 3 | +2.0, +5.0, -1.0 | +2.0 | "
            "-5.5 to +9.5 | inconclusive |") in out
    assert "LoGRA leads dense Adam, no control: +5.7 points, 95% CI +4.2 to +7.1 over 3 seeds, all above 0" in out
    # A wider margin turns the first into parity; the verdicts by hand for a few intervals.
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out"), "--margin", "10"])
    assert "parity: LoGRA and dense Adam, same KL control differ by less than 10 points" in capsys.readouterr().out
    seeds = {seed: {"before": 0.0, "after": 0.0} for seed in (1, 2, 3)}
    def verdict(differences, margin=5.0):
        first = {seed: {"before": 0.0, "after": value} for seed, value in zip(seeds, differences)}
        return tool.paired_difference(first, seeds, margin)["verdict"]
    assert verdict([-4.0, -6.0, -5.0]) == "trails"
    assert verdict([1.0, -1.0, 0.5]) == "parity"  # mean 1/6, half-width 2.59: within +-5
    assert verdict([4.0]) == "one seed"


def test_bf16_rows_compare_the_accuracy_at_the_end_of_the_job(tmp_path):
    """The --bf16 master modes are whole jobs whose warm-ups end at different accuracies: they are
    compared by the accuracy after RL, not by the lift (which would favour the worse warm-up)."""
    tool = load_tool()
    runs = tmp_path / "runs"
    for seed, (fp32_before, fp32_after, sr_before, sr_after) in enumerate(
            ((30.0, 60.0, 16.0, 62.0), (32.0, 58.0, 18.0, 57.0), (31.0, 61.0, 20.0, 62.0)), 1):
        write_run(runs, f"bf16-fp32_s{seed}", before=fp32_before, after=fp32_after)
        write_run(runs, f"bf16-sr_s{seed}", before=sr_before, after=sr_after)
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    paired = json.loads((tmp_path / "out" / "toy_parity.json").read_text())["paired"]["bf16-sr - bf16-fp32"]
    # By hand: differences of the final accuracy +2, -1, +1 (the lifts' would be +16, +13, +12):
    # mean 2/3, sd sqrt((16 + 25 + 1) / 9 / 2) = 1.5275, half-width 4.3027 * 1.5275 / sqrt(3) = 3.7947.
    assert paired["measure"] == "after" and paired["differences"] == [2.0, -1.0, 1.0]
    assert paired["ci95"] == pytest.approx([2 / 3 - 3.7947, 2 / 3 + 3.7947], abs=1e-3)
    assert paired["verdict"] == "parity"  # within +-5 points
    assert set(json.loads((tmp_path / "out" / "toy_parity.json").read_text())["paired"]) == {"bf16-sr - bf16-fp32"}


def test_learning_rate_search_table_and_best_lr(tmp_path, capsys):
    tool = load_tool()
    runs = tmp_path / "runs"
    search = runs / "lr_search"
    for rate, after in (("1e-4", 30.0), ("3e-4", 45.0), ("1e-3", 25.0)):
        write_run(search, f"logra_lr{rate}_s9", before=20.0, after=after, lr=float(rate))
    write_run(search, "adam-kl_lr1e-4_s9", before=20.0, after=28.0)
    write_run(search, "adam-kl_lr3e-4_s9", before=20.0, after=0.0, finished=False)
    tool.main(["--runs", str(runs), "--best-lr", "logra"])
    assert capsys.readouterr().out == "3e-4\n"
    with pytest.raises(SystemExit) as stop:  # the search of adam-kl is not finished
        tool.main(["--runs", str(runs), "--best-lr", "adam-kl"])
    error = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and error.startswith("error:") and "not finished at lr 3e-4" in error
    # Seeded runs at another lr than the search's best are pointed out.
    write_run(runs, "logra_s1", before=20.0, after=40.0, lr=1e-3)
    tool.main(["--runs", str(runs), "--name", "toy", "--out-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "| LoGRA | **3e-4** | 20.0 | 45.0 (" in out and "| **+25.0** |" in out
    assert "| LoGRA | 1e-3 | 20.0 | 25.0 (" in out and "| dense Adam, same KL control | 3e-4 | not finished |" in out
    assert "note: the seeded LoGRA runs used lr 0.001, its search's best is 3e-4" in out
    report = json.loads((tmp_path / "out" / "toy_parity.json").read_text())
    assert report["best_lr"] == {"logra": "3e-4", "adam-kl": "1e-4"}
    assert report["lr_search"]["logra"]["1e-4"]["after"] == 30.0
