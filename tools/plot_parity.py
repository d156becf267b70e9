"""Tabulate and plot dense-Adam vs LoGRA runs made by ``launch/parity_runs.sh``.

    python tools/plot_parity.py --runs OUT --name smollm2 [--out-dir docs/results] [--window 1]

Reads every ``OUT/<optimizer>_s<seed>/{summary.json,metrics.jsonl}``, prints a Markdown table
(held-out greedy accuracy before and after RL with Wilson 95% intervals, the measured training
state, wall time) and writes ``<out-dir>/<name>_parity.json`` (per run and per optimizer) and
``<out-dir>/<name>_parity.png``: training reward and batch accuracy against the RL step (thin:
each seed; thick: the mean over seeds) and held-out accuracy before/after with its interval.

Per optimizer, the held-out accuracies of its seeds are pooled (correct answers over problems
evaluated) into one Wilson interval. The seeds share one held-out set, so that interval is
narrower than independent problems would give; the per-seed intervals are listed beside it.
"""

import json
import math
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.rl.evaluation import wilson_interval  # noqa: E402

OPTIMIZERS = ("adam", "logra")
LABELS = {"adam": "dense Adam", "logra": "LoGRA"}
COLORS = {"adam": "tab:blue", "logra": "tab:orange"}


def parse_args(argv=None):
    parser = ArgumentParser(prog="plot_parity.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="the OUT folder of launch/parity_runs.sh")
    parser.add_argument("--name", required=True, help="prefix of the written files (e.g. smollm2, tiny)")
    parser.add_argument("--out-dir", default=os.path.join("docs", "results"))
    parser.add_argument("--window", type=int, default=1,
                        help="moving-average window over RL steps for the curves (default: 1, none)")
    return parser.parse_args(argv)


def read_run(path: str) -> dict:
    with open(os.path.join(path, "summary.json")) as handle:
        summary = json.load(handle)
    rows = []
    with open(os.path.join(path, "metrics.jsonl")) as handle:
        for number, line in enumerate(handle, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UserError(f"{path}/metrics.jsonl line {number}: not JSON ({error.msg})") from None
    rl = [row for row in rows if row.get("phase", "rl") == "rl" and "reward_mean" in row]
    if not summary.get("finished") or "held_out_accuracy_after" not in summary:
        raise UserError(f"{path}: the run did not finish (no final accuracy in summary.json); "
                        "re-run launch/parity_runs.sh to complete it")
    before = summary.get("evaluation_before") or summary.get("evaluation_initial") or {}
    after = summary.get("evaluation_after") or {}
    state = [row["state_bytes"] for row in rl if "state_bytes" in row]
    extra = [row.get("controller_extra_bytes", 0.0) for row in rl]
    return {
        "before": summary["held_out_accuracy_before"], "after": summary["held_out_accuracy_after"],
        "before_ci95": [round(100 * v, 2) for v in before.get("greedy_ci95", [])],
        "after_ci95": [round(100 * v, 2) for v in after.get("greedy_ci95", [])],
        "problems": after.get("problems"), "rl_steps": len(rl), "wall_time_s": round(summary["wall_time_s"], 1),
        "state_bytes": int(max(state)) if state else None,
        "controller_extra_bytes": int(max(extra)) if extra else 0,
        "planned_gpu_bytes": summary.get("memory_plan_bytes", {}).get(summary["optimizer"]),
        "curves": {"step": [row["step"] for row in rl], "reward": [row["reward_mean"] for row in rl],
                   "accuracy": [row["accuracy"] for row in rl]},
    }


def read_runs(folder: str) -> Dict[str, Dict[int, dict]]:
    if not os.path.isdir(folder):
        raise UserError(f"--runs {folder}: no such folder")
    runs: Dict[str, Dict[int, dict]] = {name: {} for name in OPTIMIZERS}
    for entry in sorted(os.listdir(folder)):
        optimizer, _, seed = entry.partition("_s")
        if optimizer in runs and seed.isdigit() and os.path.exists(os.path.join(folder, entry, "summary.json")):
            runs[optimizer][int(seed)] = read_run(os.path.join(folder, entry))
    if not any(runs.values()):
        raise UserError(f"--runs {folder}: no finished <optimizer>_s<seed>/summary.json in it")
    return runs


def pooled(results: List[dict], key: str) -> dict:
    """Accuracy over all seeds' held-out answers, with its Wilson interval."""
    problems = sum(run["problems"] or 0 for run in results)
    if not problems:
        return {}
    correct = sum(round(run[key] / 100 * (run["problems"] or 0)) for run in results)
    low, high = wilson_interval(correct / problems, problems)
    return {"accuracy": round(100 * correct / problems, 2), "ci95": [round(100 * low, 2), round(100 * high, 2)],
            "problems": problems}


def aggregate(runs: Dict[str, Dict[int, dict]]) -> dict:
    table = {}
    for optimizer, by_seed in runs.items():
        results = list(by_seed.values())
        if not results:
            continue
        lifts = [run["after"] - run["before"] for run in results]
        mean = sum(lifts) / len(lifts)
        spread = math.sqrt(sum((v - mean) ** 2 for v in lifts) / (len(lifts) - 1)) if len(lifts) > 1 else 0.0
        table[optimizer] = {
            "seeds": sorted(by_seed), "before": pooled(results, "before"), "after": pooled(results, "after"),
            "lift_mean": round(mean, 2), "lift_std": round(spread, 2),
            "state_bytes": max(run["state_bytes"] or 0 for run in results),
            "wall_time_s_mean": round(sum(run["wall_time_s"] for run in results) / len(results), 1),
        }
    return table


def markdown(runs: Dict[str, Dict[int, dict]], table: dict) -> str:
    def interval(values):
        return f"{values[0]:.1f}-{values[1]:.1f}" if values else "-"

    lines = ["| optimizer | seed | held-out before (95% CI) | after (95% CI) | lift | training state MiB | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for optimizer in OPTIMIZERS:
        for seed, run in sorted(runs[optimizer].items()):
            lines.append(f"| {LABELS[optimizer]} | {seed} | {run['before']:.1f} ({interval(run['before_ci95'])}) | "
                         f"{run['after']:.1f} ({interval(run['after_ci95'])}) | {run['after'] - run['before']:+.1f} | "
                         f"{(run['state_bytes'] or 0) / 2**20:.1f} | {run['wall_time_s']:.0f} |")
        if optimizer in table:
            row = table[optimizer]
            lines.append(f"| **{LABELS[optimizer]}, pooled** | {len(row['seeds'])} seeds | "
                         f"{row['before']['accuracy']:.1f} ({interval(row['before']['ci95'])}) | "
                         f"**{row['after']['accuracy']:.1f}** ({interval(row['after']['ci95'])}) | "
                         f"{row['lift_mean']:+.1f} ± {row['lift_std']:.1f} | {row['state_bytes'] / 2**20:.1f} | "
                         f"{row['wall_time_s_mean']:.0f} |")
    return "\n".join(lines)


def moving_average(values: List[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: Dict[str, Dict[int, dict]], name: str, window: int, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install -e .[plot]") from None
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for optimizer in OPTIMIZERS:
        by_seed = runs[optimizer]
        if not by_seed:
            continue
        color = COLORS[optimizer]
        for panel, key in ((0, "reward"), (1, "accuracy")):
            curves = [run["curves"] for run in by_seed.values()]
            for curve in curves:
                axes[panel].plot(curve["step"], moving_average(curve[key], window), color=color, alpha=0.25, lw=0.8)
            length = min(len(curve["step"]) for curve in curves)
            mean = [sum(curve[key][i] for curve in curves) / len(curves) for i in range(length)]
            axes[panel].plot(curves[0]["step"][:length], moving_average(mean, window), color=color, lw=2,
                             label=f"{LABELS[optimizer]} (mean of {len(curves)})")
        for offset, (seed, run) in enumerate(sorted(by_seed.items())):
            x = [0, run["rl_steps"]]
            shift = (offset - len(by_seed) / 2) * 0.01 * run["rl_steps"] + (0.004 * run["rl_steps"]
                                                                           if optimizer == "logra" else 0)
            y = [run["before"], run["after"]]
            errors = [[y[i] - ci[0] for i, ci in enumerate((run["before_ci95"], run["after_ci95"]))],
                      [ci[1] - y[i] for i, ci in enumerate((run["before_ci95"], run["after_ci95"]))]]
            axes[2].errorbar([v + shift for v in x], y, yerr=errors, color=color, marker="o", ms=3, lw=0.8,
                             capsize=2, alpha=0.8, label=LABELS[optimizer] if offset == 0 else None)
    smoothing = f", moving average over {window} steps" if window > 1 else ""
    axes[0].set(title=f"training reward{smoothing}", xlabel="RL step", ylabel="mean reward")
    axes[1].set(title=f"training batch accuracy{smoothing}", xlabel="RL step", ylabel="share of rollouts correct")
    axes[2].set(title="held-out greedy accuracy (95% CI), per seed", xlabel="RL step", ylabel="accuracy %")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"{name}: dense Adam vs LoGRA")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    if args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}")
    runs = read_runs(args.runs)
    table = aggregate(runs)
    os.makedirs(args.out_dir, exist_ok=True)
    report = {"name": args.name, "optimizers": table,
              "runs": {opt: {seed: {k: v for k, v in run.items() if k != "curves"} for seed, run in by_seed.items()}
                       for opt, by_seed in runs.items()},
              "curves": {opt: {seed: run["curves"] for seed, run in by_seed.items()} for opt, by_seed in runs.items()}}
    json_path = os.path.join(args.out_dir, f"{args.name}_parity.json")
    with open(json_path, "w") as handle:
        json.dump(report, handle, indent=1)
    png_path = os.path.join(args.out_dir, f"{args.name}_parity.png")
    plot(runs, args.name, args.window, png_path)
    print(markdown(runs, table))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
