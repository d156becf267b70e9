"""Tabulate and plot the dense-Adam vs LoGRA runs made by ``launch/parity_runs.sh``.

    python tools/plot_parity.py --runs OUT --name smollm2 [--out-dir docs/results] [--window 1] [--margin 5]
    python tools/plot_parity.py --runs OUT --best-lr logra      # the lr search's best lr of a row, alone

Reads every ``OUT/<row>_s<seed>/{summary.json,metrics.jsonl}`` and the learning-rate search's
``OUT/lr_search/<row>_lr<lr>_s<seed>/``. The rows (``bf16-fp32`` and ``bf16-sr``: the main job
with ``--bf16`` and each ``--logra-master``): ``logra`` (LoGRA with the predicted-KL
controller), ``adam-kl`` (dense Adam under the same controller: same ``--kl-target``,
``--kl-max-scale`` and probe), ``adam`` (dense Adam without control, as users run it),
``logra-decay`` (LoGRA with the budget decaying on ``--kl-target-schedule cosine``). Prints
Markdown tables and writes ``<out-dir>/<name>_parity.json`` (the tables), ``<out-dir>/<name>_parity_curves.json``
(each run's per-step reward and accuracy, one line) and ``<out-dir>/<name>_parity.png``
(training reward and batch accuracy against the RL step: thin per seed, thick the mean; held-out
accuracy before/after with its interval).

1. The learning-rate search: held-out accuracy after RL and the lift (after - before, points)
   of each row at each lr, one seed; the best lr of a row is the one with the largest lift
   (ties: the higher accuracy after, then the smaller lr). ``--best-lr ROW`` prints it alone
   (``launch/parity_runs.sh`` runs the seeded rows at it).
2. The seeded runs: held-out greedy accuracy before and after RL with Wilson 95% intervals, per
   seed and pooled over seeds (correct answers over problems evaluated; the seeds share one
   held-out set, so the pooled interval is narrower than independent problems would give), the
   lift's mean and standard deviation over seeds, the peak lr each run used, training state, wall time.
3. The comparison: the **paired difference of lifts**, ``lift(LoGRA) - lift(dense)`` seed by
   seed (the seed fixes the prompts, the sampling and the starting weights, so the pair shares
   them), its mean and a **paired t interval** over the seeds (95%, Student's t with n - 1
   degrees of freedom: ``mean +- t * sd / sqrt(n)``). The verdict, with ``--margin M`` points
   (default 5):

   - *leads*: the whole interval is above 0;
   - *trails*: the whole interval is below 0;
   - *parity*: the interval contains 0 and lies within ``[-M, +M]`` (a difference larger than
     M points is excluded);
   - *inconclusive*: the interval contains 0 but reaches beyond ``+-M`` (neither a difference
     nor parity is shown: more seeds or problems are needed);
   - with one seed in common there is no interval.

   Compared: LoGRA against dense Adam under the same control (the main comparison), against
   dense Adam without control, and ``logra-decay`` against ``logra`` (whether the budget's
   schedule changes the result), each when both rows have runs on common seeds; and for the
   ``--bf16`` default, ``bf16-sr`` against ``bf16-fp32`` by the held-out accuracy at the end of
   the whole job (their warm-ups differ, so the lift alone would not say what a user gets).
"""

import json
import math
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402

ROWS = ("logra", "adam-kl", "adam", "logra-decay", "bf16-fp32", "bf16-sr")
LABELS = {"logra": "LoGRA", "adam-kl": "dense Adam, same KL control", "adam": "dense Adam, no control",
          "logra-decay": "LoGRA, decaying KL budget", "bf16-fp32": "LoGRA --bf16, fp32 masters",
          "bf16-sr": "LoGRA --bf16, bf16-sr (no master)"}
COLORS = {"logra": "tab:orange", "adam-kl": "tab:blue", "adam": "tab:gray", "logra-decay": "tab:red",
          "bf16-fp32": "tab:green", "bf16-sr": "tab:purple"}
MEASURES = {"lift": "lift (points gained in RL)", "after": "held-out accuracy at the end of the job"}
COMPARISONS = (("logra", "adam-kl", "lift"), ("logra", "adam", "lift"), ("logra-decay", "logra", "lift"),
               ("bf16-sr", "bf16-fp32", "after"))
"""(first, second, measure): the paired difference ``measure(first) - measure(second)``; the first
is the main one. The bf16 rows are the whole main job, warm-up included (whose result differs
with the master mode), so they compare what a user gets at the end, not the RL lift."""
LR_SEARCH = "lr_search"
CONFIDENCE = 0.95


def parse_args(argv=None):
    parser = ArgumentParser(prog="plot_parity.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="the OUT folder of launch/parity_runs.sh")
    parser.add_argument("--name", help="prefix of the written files (e.g. smollm2, tiny)")
    parser.add_argument("--out-dir", default=os.path.join("docs", "results"))
    parser.add_argument("--window", type=int, default=1,
                        help="moving-average window over RL steps for the curves (default: 1, none)")
    parser.add_argument("--margin", type=float, default=5.0,
                        help="parity margin in points of held-out accuracy: parity is claimed when the paired "
                             "interval of the difference of lifts lies within +-margin (default: 5)")
    parser.add_argument("--best-lr", metavar="ROW", choices=ROWS,
                        help="print the best lr of ROW's finished learning-rate search and nothing else")
    return parser.parse_args(argv)


# --- reading runs ------------------------------------------------------------------------------

def read_run(path: str) -> dict:
    with open(os.path.join(path, "summary.json")) as handle:
        summary = json.load(handle)
    rows = []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.exists(metrics):  # (docs/results/runs keeps only the summaries: no curves, no measured state)
        with open(metrics) as handle:
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
    rates = [row["lr"] for row in rl if "lr" in row]
    return {
        "before": summary["held_out_accuracy_before"], "after": summary["held_out_accuracy_after"],
        "before_ci95": [round(100 * v, 2) for v in before.get("greedy_ci95", [])],
        "after_ci95": [round(100 * v, 2) for v in after.get("greedy_ci95", [])],
        "problems": after.get("problems"), "rl_steps": len(rl) or summary.get("steps", 0),
        "wall_time_s": round(summary["wall_time_s"], 1),
        "peak_lr": max(rates) if rates else None,
        "state_bytes": int(max(state)) if state else None,
        "controller_extra_bytes": int(max(extra)) if extra else 0,
        "planned_gpu_bytes": summary.get("memory_plan_bytes", {}).get(summary["optimizer"]),
        "curves": {"step": [row["step"] for row in rl], "reward": [row["reward_mean"] for row in rl],
                   "accuracy": [row["accuracy"] for row in rl]},
    }


def lift(run: dict) -> float:
    """Points of held-out accuracy gained in RL."""
    return run["after"] - run["before"]


def read_runs(folder: str) -> Dict[str, Dict[int, dict]]:
    """``row -> seed -> run`` for every finished ``<row>_s<seed>`` under ``folder``."""
    if not os.path.isdir(folder):
        raise UserError(f"--runs {folder}: no such folder")
    runs: Dict[str, Dict[int, dict]] = {row: {} for row in ROWS}
    for entry in sorted(os.listdir(folder)):
        row, _, seed = entry.rpartition("_s")
        if row in runs and seed.isdigit() and os.path.exists(os.path.join(folder, entry, "summary.json")):
            runs[row][int(seed)] = read_run(os.path.join(folder, entry))
    return runs


def read_lr_search(folder: str) -> Dict[str, Dict[str, dict]]:
    """``row -> lr text -> run`` of ``folder/lr_search/<row>_lr<lr>_s<seed>`` (a run that has not
    finished is ``{"finished": False}``)."""
    search: Dict[str, Dict[str, dict]] = {}
    root = os.path.join(folder, LR_SEARCH)
    if not os.path.isdir(root):
        return search
    for entry in sorted(os.listdir(root)):
        head, _, seed = entry.rpartition("_s")
        row, _, rate = head.rpartition("_lr")
        if row not in ROWS or not seed.isdigit() or not _is_number(rate):
            continue
        path = os.path.join(root, entry)
        try:
            run = dict(read_run(path), finished=True, seed=int(seed))
        except (OSError, UserError):  # not finished (yet)
            run = {"finished": False, "seed": int(seed)}
        search.setdefault(row, {})[rate] = run
    return {row: dict(sorted(by_lr.items(), key=lambda item: float(item[0]))) for row, by_lr in search.items()}


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def best_lr(by_lr: Dict[str, dict]) -> Optional[str]:
    """The lr (as written) with the largest lift among the finished runs; ties: the higher
    accuracy after, then the smaller lr."""
    finished = [(rate, run) for rate, run in by_lr.items() if run["finished"]]
    if not finished:
        return None
    return max(finished, key=lambda item: (lift(item[1]), item[1]["after"], -float(item[0])))[0]


# --- statistics --------------------------------------------------------------------------------

def student_t_two_sided(t: float, df: int) -> float:
    """``P(|T| < t)`` for Student's t with ``df`` degrees of freedom (Abramowitz & Stegun
    26.7.3-4, exact for whole ``df``)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= 2 * k / (2 * k + 1) * cos2
        return 2 / math.pi * (theta + (math.sin(theta) * total if df > 1 else 0.0))
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):
        total += term
        term *= (2 * k - 1) / (2 * k) * cos2
    return math.sin(theta) * total


def student_t_quantile(confidence: float, df: int) -> float:
    """The ``t`` with ``P(|T| < t) = confidence`` (e.g. 0.95: the 97.5% quantile), by bisection."""
    low, high = 0.0, 1.0
    while student_t_two_sided(high, df) < confidence:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if student_t_two_sided(middle, df) < confidence:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def measured(run: dict, measure: str) -> float:
    """What a comparison compares (``MEASURES``): the lift, or the accuracy at the end."""
    return lift(run) if measure == "lift" else run["after"]


def paired_difference(first: Dict[int, dict], second: Dict[int, dict], margin: float,
                      measure: str = "lift") -> Optional[dict]:
    """``measure(first) - measure(second)`` (the lift by default) on the seeds both have, its mean
    and paired t interval, and the verdict (module docstring); None when they share no seed."""
    seeds = sorted(set(first) & set(second))
    if not seeds:
        return None
    differences = [measured(first[seed], measure) - measured(second[seed], measure) for seed in seeds]
    count = len(differences)
    mean = sum(differences) / count
    result = {"measure": measure, "seeds": seeds, "differences": [round(value, 4) for value in differences],
              "mean": round(mean, 4),
              "sd": None, "t": None, "ci95": None, "margin": margin,
              "interval": f"paired t, {count - 1} degrees of freedom, {round(100 * CONFIDENCE)}%"}
    if count < 2:
        result["verdict"] = "one seed"
        return result
    sd = math.sqrt(sum((value - mean) ** 2 for value in differences) / (count - 1))
    t = student_t_quantile(CONFIDENCE, count - 1)
    half = t * sd / math.sqrt(count)
    low, high = mean - half, mean + half
    if low > 0:
        verdict = "leads"
    elif high < 0:
        verdict = "trails"
    elif -margin <= low and high <= margin:
        verdict = "parity"
    else:
        verdict = "inconclusive"
    result.update(sd=round(sd, 4), t=round(t, 6), ci95=[round(low, 4), round(high, 4)], verdict=verdict)
    return result


def verdict_text(first: str, second: str, paired: dict) -> str:
    """The verdict in words."""
    a, b = LABELS[first], LABELS[second]
    verdict, margin = paired["verdict"], paired["margin"]
    if verdict == "one seed":
        return f"one seed in common: no interval, no verdict ({a} minus {b}: {paired['mean']:+.1f} points)"
    low, high = paired["ci95"]
    interval = f"{paired['mean']:+.1f} points, 95% CI {low:+.1f} to {high:+.1f} over {len(paired['seeds'])} seeds"
    if verdict == "leads":
        return f"{a} leads {b}: {interval}, all above 0"
    if verdict == "trails":
        return f"{a} trails {b}: {interval}, all below 0"
    if verdict == "parity":
        return f"parity: {a} and {b} differ by less than {margin:g} points ({interval})"
    return (f"inconclusive: {interval} contains 0 but reaches beyond +-{margin:g} points; neither a "
            f"difference nor parity is shown")


def pooled(results: List[dict], key: str) -> dict:
    """Accuracy over all seeds' held-out answers, with its Wilson interval."""
    from logra_megatron.rl.evaluation import wilson_interval  # (imports torch: not for --best-lr)

    problems = sum(run["problems"] or 0 for run in results)
    if not problems:
        return {}
    correct = sum(round(run[key] / 100 * (run["problems"] or 0)) for run in results)
    low, high = wilson_interval(correct / problems, problems)
    return {"accuracy": round(100 * correct / problems, 2), "ci95": [round(100 * low, 2), round(100 * high, 2)],
            "problems": problems}


def aggregate(runs: Dict[str, Dict[int, dict]]) -> dict:
    table = {}
    for row, by_seed in runs.items():
        results = list(by_seed.values())
        if not results:
            continue
        lifts = [lift(run) for run in results]
        mean = sum(lifts) / len(lifts)
        spread = math.sqrt(sum((v - mean) ** 2 for v in lifts) / (len(lifts) - 1)) if len(lifts) > 1 else 0.0
        table[row] = {
            "seeds": sorted(by_seed), "before": pooled(results, "before"), "after": pooled(results, "after"),
            "lift_mean": round(mean, 2), "lift_std": round(spread, 2),
            "peak_lr": sorted({run["peak_lr"] for run in results if run["peak_lr"] is not None}),
            "state_bytes": max(run["state_bytes"] or 0 for run in results),
            "wall_time_s_mean": round(sum(run["wall_time_s"] for run in results) / len(results), 1),
        }
    return table


# --- tables ------------------------------------------------------------------------------------

def _interval(values):
    return f"{values[0]:.1f}-{values[1]:.1f}" if values else "-"


def _mib(value) -> str:
    return f"{value / 2**20:.1f}" if value else "-"


def _lr(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def search_markdown(search: Dict[str, Dict[str, dict]], best: Dict[str, Optional[str]]) -> str:
    seeds = sorted({run["seed"] for by_lr in search.values() for run in by_lr.values()})
    lines = [f"Learning-rate search (seed {', '.join(map(str, seeds))}; the best lr of each row in bold: the "
             "largest lift)", "",
             "| row | lr | held-out before | after (95% CI) | lift | wall s |", "| --- | --- | --- | --- | --- | --- |"]
    for row in ROWS:
        for rate, run in search.get(row, {}).items():
            if not run["finished"]:
                lines.append(f"| {LABELS[row]} | {rate} | not finished | | | |")
                continue
            mark = "**" if rate == best.get(row) else ""
            lines.append(f"| {LABELS[row]} | {mark}{rate}{mark} | {run['before']:.1f} | "
                         f"{run['after']:.1f} ({_interval(run['after_ci95'])}) | {mark}{lift(run):+.1f}{mark} | "
                         f"{run['wall_time_s']:.0f} |")
    return "\n".join(lines)


def runs_markdown(runs: Dict[str, Dict[int, dict]], table: dict) -> str:
    lines = ["| row | seed | lr | held-out before (95% CI) | after (95% CI) | lift | training state MiB | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in ROWS:
        for seed, run in sorted(runs[row].items()):
            lines.append(f"| {LABELS[row]} | {seed} | {_lr(run['peak_lr'])} | {run['before']:.1f} "
                         f"({_interval(run['before_ci95'])}) | {run['after']:.1f} ({_interval(run['after_ci95'])}) | "
                         f"{lift(run):+.1f} | {_mib(run['state_bytes'])} | {run['wall_time_s']:.0f} |")
        if row in table:
            pool = table[row]
            lines.append(f"| **{LABELS[row]}, pooled** | {len(pool['seeds'])} seeds | "
                         f"{', '.join(_lr(v) for v in pool['peak_lr']) or '-'} | "
                         f"{pool['before']['accuracy']:.1f} ({_interval(pool['before']['ci95'])}) | "
                         f"**{pool['after']['accuracy']:.1f}** ({_interval(pool['after']['ci95'])}) | "
                         f"{pool['lift_mean']:+.1f} ± {pool['lift_std']:.1f} | {_mib(pool['state_bytes'])} | "
                         f"{pool['wall_time_s_mean']:.0f} |")
    return "\n".join(lines)


def paired_markdown(comparisons: Dict[str, dict]) -> str:
    lines = ["Paired differences (first minus second, seed by seed; 95% paired t interval over the seeds)", "",
             "| comparison | of | seeds | differences (points) | mean | 95% CI | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, paired in comparisons.items():
        first, second = key.split(" - ")
        differences = ", ".join(f"{value:+.1f}" for value in paired["differences"])
        interval = "-" if paired["ci95"] is None else f"{paired['ci95'][0]:+.1f} to {paired['ci95'][1]:+.1f}"
        lines.append(f"| {LABELS[first]} - {LABELS[second]} | {MEASURES[paired['measure']]} | "
                     f"{len(paired['seeds'])} | {differences} | {paired['mean']:+.1f} | {interval} | "
                     f"{paired['verdict']} |")
    lines.append("")
    lines.extend(f"- {paired['text']}" for paired in comparisons.values())
    return "\n".join(lines)


# --- plot --------------------------------------------------------------------------------------

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
    for index, row in enumerate(ROWS):
        by_seed = runs[row]
        if not by_seed:
            continue
        color = COLORS[row]
        for panel, key in ((0, "reward"), (1, "accuracy")):
            curves = [run["curves"] for run in by_seed.values()]
            for curve in curves:
                axes[panel].plot(curve["step"], moving_average(curve[key], window), color=color, alpha=0.25, lw=0.8)
            length = min(len(curve["step"]) for curve in curves)
            mean = [sum(curve[key][i] for curve in curves) / len(curves) for i in range(length)]
            axes[panel].plot(curves[0]["step"][:length], moving_average(mean, window), color=color, lw=2,
                             label=f"{LABELS[row]} (mean of {len(curves)})")
        for offset, (seed, run) in enumerate(sorted(by_seed.items())):
            x = [0, run["rl_steps"]]
            shift = ((offset - len(by_seed) / 2) * 0.01 + 0.004 * index) * run["rl_steps"]
            y = [run["before"], run["after"]]
            errors = [[y[i] - ci[0] if ci else 0 for i, ci in enumerate((run["before_ci95"], run["after_ci95"]))],
                      [ci[1] - y[i] if ci else 0 for i, ci in enumerate((run["before_ci95"], run["after_ci95"]))]]
            axes[2].errorbar([v + shift for v in x], y, yerr=errors, color=color, marker="o", ms=3, lw=0.8,
                             capsize=2, alpha=0.8, label=LABELS[row] if offset == 0 else None)
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


# --- main --------------------------------------------------------------------------------------

def print_best_lr(folder: str, row: str) -> None:
    if not os.path.isdir(folder):
        raise UserError(f"--runs {folder}: no such folder")
    by_lr = read_lr_search(folder).get(row, {})
    if not by_lr:
        raise UserError(f"no learning-rate search of {row} under {os.path.join(folder, LR_SEARCH)}: run "
                        "launch/parity_runs.sh <kind> OUT search first")
    unfinished = [rate for rate, run in by_lr.items() if not run["finished"]]
    if unfinished:
        raise UserError(f"the learning-rate search of {row} has not finished at lr {', '.join(unfinished)}: "
                        "re-run launch/parity_runs.sh <kind> OUT search to complete it")
    print(best_lr(by_lr))


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    if args.best_lr:
        print_best_lr(args.runs, args.best_lr)
        return
    if not args.name:
        raise UserError("--name is needed (the prefix of the written files), unless --best-lr")
    if args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}")
    if not args.margin > 0:
        raise UserError(f"--margin must be > 0 points, got {args.margin}")
    runs = read_runs(args.runs)
    search = read_lr_search(args.runs)
    if not any(runs.values()) and not search:
        raise UserError(f"--runs {args.runs}: no finished <row>_s<seed>/summary.json and no {LR_SEARCH}/ in it")
    best = {row: best_lr(by_lr) for row, by_lr in search.items()}
    table = aggregate(runs)
    comparisons = {}
    for first, second, measure in COMPARISONS:
        paired = paired_difference(runs[first], runs[second], args.margin, measure)
        if paired is not None:
            comparisons[f"{first} - {second}"] = dict(paired, text=verdict_text(first, second, paired))
    os.makedirs(args.out_dir, exist_ok=True)
    report = {"name": args.name, "rows": table, "paired": comparisons,
              "lr_search": {row: {rate: {k: v for k, v in run.items() if k != "curves"} for rate, run in by_lr.items()}
                            for row, by_lr in search.items()},
              "best_lr": best,
              "runs": {row: {seed: {k: v for k, v in run.items() if k != "curves"} for seed, run in by_seed.items()}
                       for row, by_seed in runs.items()}}
    json_path = os.path.join(args.out_dir, f"{args.name}_parity.json")
    with open(json_path, "w") as handle:
        json.dump(report, handle, indent=1)
    written = [json_path]
    if any(runs.values()):
        # The per-step curves (what the plot draws): a file of their own, one line, so that the
        # tables stay a short file to read and diff (docs/results/README.md).
        curves_path = os.path.join(args.out_dir, f"{args.name}_parity_curves.json")
        with open(curves_path, "w") as handle:
            json.dump({row: {seed: run["curves"] for seed, run in by_seed.items()} for row, by_seed in runs.items()},
                      handle)
        written.append(curves_path)
    sections = []
    if search:
        sections.append(search_markdown(search, best))
    if any(runs.values()):
        for row, pool in table.items():  # a seeded row not at its search's best lr is pointed out
            if best.get(row) is not None and pool["peak_lr"] and any(
                    not math.isclose(rate, float(best[row]), rel_tol=1e-6) for rate in pool["peak_lr"]):
                sections.append(f"note: the seeded {LABELS[row]} runs used lr {', '.join(map(_lr, pool['peak_lr']))}, "
                                f"its search's best is {best[row]}")
        sections.append(runs_markdown(runs, table))
        if comparisons:
            sections.append(paired_markdown(comparisons))
        png_path = os.path.join(args.out_dir, f"{args.name}_parity.png")
        plot(runs, args.name, args.window, png_path)
        written.append(png_path)
    print("\n\n".join(sections))
    print(f"wrote {' and '.join(written)}")


if __name__ == "__main__":
    main()
