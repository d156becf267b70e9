"""The Python side of ``launch/scaling_sweep.sh``: whether a layout runs, and the sweep's table.

    python tools/scaling_sweep.py check --nproc 4 -- --tensor-model-parallel-size 4 ...
    python tools/scaling_sweep.py table --out runs/scaling_sweep --layouts "1x1 2x2" \\
        --optimizers "adam logra"

``check`` runs the smoke job's own checks (flags, layout against the model, batch sizes) on the
smoke job's arguments for ``--nproc`` ranks, without starting a process: it prints nothing and
exits 0 when the layout runs, or prints the reason and exits 3.

``table`` reads, for every layout and optimizer, ``<out>/tp{T}_pp{P}_{optimizer}.json`` (the
smoke job's ``--report-json``), or ``.skip`` (the reason a layout does not run), or else reports
the run as failed with the last error line of its ``.log``. It writes ``<out>/table.md`` and
``<out>/table.json`` and prints the markdown. Every row has every cell: a skipped or failed
run says so in each figure and gives the reason in its last cell.

Figures per run (per step; all measured, see ``logra_megatron/training/measure.py``):
training state per rank (max over ranks, and every rank's), the peak of allocations during one
step (max over ranks), the step time (median of the timed steps, slowest rank), the bytes passed
to collectives on TP, PP and DP groups and on groups spanning more than one of them (summed over
ranks), and the final loss.
"""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402

KINDS = ("tp", "pp", "dp")
COLUMNS = ("layout (tp x pp x dp)", "optimizer", "state KiB/rank (max)", "state KiB by rank",
           "peak step KiB (max)", "step s", "TP KiB", "PP KiB", "DP KiB", "mixed-group KiB",
           "final loss", "note")


def run_name(tp: int, pp: int, optimizer: str) -> str:
    return f"tp{tp}_pp{pp}_{optimizer}"


def parse_layouts(text: str) -> list:
    """``"1x1 2x2"`` -> ``[(1, 1), (2, 2)]`` (TP x PP)."""
    layouts = []
    for item in text.split():
        match = re.fullmatch(r"(\d+)x(\d+)", item)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise UserError(f"layout {item!r} is not TPxPP with positive sizes (e.g. 2x1)")
        layouts.append((int(match.group(1)), int(match.group(2))))
    if not layouts:
        raise UserError("no layouts given")
    return layouts


def check(nproc: int, smoke_args: list) -> int:
    from logra_megatron.smoke import parse_args, validate

    try:
        validate(parse_args(smoke_args), nproc)
    except UserError as error:
        print(error)
        return 3
    return 0


def kib(value: float) -> str:
    return f"{value / 1024:.1f}"


def summarize(report: dict) -> dict:
    """One table row's figures from a smoke job's per-rank report."""
    ranks = sorted(report["ranks"], key=lambda rank: rank["rank"])
    moved = {kind: 0 for kind in KINDS}
    mixed = {}
    for rank in ranks:
        for kind, size in rank["comm_bytes_by_kind"].items():
            if kind in moved:
                moved[kind] += size
            elif kind != "self":  # a group of one rank moves nothing
                mixed[kind] = mixed.get(kind, 0) + size
    return {
        "state_bytes_max": max(rank["training_state_bytes"] for rank in ranks),
        "state_bytes_by_rank": [rank["training_state_bytes"] for rank in ranks],
        "components_by_rank": [{key: value for key, value in rank.items() if key.endswith("_bytes")
                                and key not in ("peak_step_bytes", "training_state_bytes")}
                               for rank in ranks],
        "peak_step_bytes_max": max(rank["peak_step_bytes"] for rank in ranks),
        "peak_step_bytes_by_rank": [rank["peak_step_bytes"] for rank in ranks],
        "step_time_s": max(rank["step_time_s"] for rank in ranks),
        "comm_bytes": {**moved, "mixed": sum(mixed.values())},
        "comm_mixed_groups": mixed,
        "comm_by_rank": [rank["comm_bytes_by_kind"] for rank in ranks],
        "comm_by_op_rank0": ranks[0]["comm_by_op"],
        "final_loss": ranks[-1]["final_loss"],
    }


def failure_reason(log: Path) -> str:
    if not log.exists():
        return "no report and no log (the run did not start)"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|error:|Exception)", line)
              and "ChildFailedError" not in line]
    return (errors or lines or ["empty log"])[-1][:300]


def collect(out: Path, layouts: list, optimizers: list, nproc: int) -> list:
    rows = []
    for tp, pp in layouts:
        dp = f"{nproc // (tp * pp)}" if nproc % (tp * pp) == 0 else "n/a"
        for optimizer in optimizers:
            name = run_name(tp, pp, optimizer)
            row = {"tp": tp, "pp": pp, "dp": dp, "optimizer": optimizer, "run": name}
            report, skip = out / f"{name}.json", out / f"{name}.skip"
            if report.exists():
                row.update(status="ok", note="ok", **summarize(json.loads(report.read_text())))
            elif skip.exists():
                row.update(status="skipped", note="skipped: " + skip.read_text().strip())
            else:
                row.update(status="failed", note="failed: " + failure_reason(out / f"{name}.log"))
            rows.append(row)
    return rows


def cells(row: dict) -> list:
    layout = f"{row['tp']} x {row['pp']} x {row['dp']}"
    if row["status"] != "ok":
        return [layout, row["optimizer"], *[row["status"]] * (len(COLUMNS) - 3), row["note"]]
    moved = row["comm_bytes"]
    return [layout, row["optimizer"], kib(row["state_bytes_max"]),
            " / ".join(kib(value) for value in row["state_bytes_by_rank"]),
            kib(row["peak_step_bytes_max"]), f"{row['step_time_s']:.3f}",
            kib(moved["tp"]), kib(moved["pp"]), kib(moved["dp"]), kib(moved["mixed"]),
            f"{row['final_loss']:.4f}", row["note"]]


def markdown(rows: list) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def build_parser():
    """``check`` and ``table``; the smoke job's flags after ``check --`` are the smoke job's own."""
    parser = ArgumentParser(prog="scaling_sweep", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checker = commands.add_parser("check", help="does the smoke job run with these arguments on --nproc ranks")
    checker.add_argument("--nproc", type=int, required=True)
    checker.add_argument("smoke_args", nargs="*", help="the smoke job's arguments (after --)")
    table = commands.add_parser("table", help="collect a sweep's reports into table.md / table.json")
    table.add_argument("--out", required=True, help="the sweep's output directory")
    table.add_argument("--layouts", required=True, help='TPxPP layouts, e.g. "1x1 2x2"')
    table.add_argument("--optimizers", default="adam logra")
    table.add_argument("--nproc", type=int, default=4)
    return parser


def parse_args(argv):
    return build_parser().parse_args(argv)


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "check":
        sys.exit(check(args.nproc, args.smoke_args))
    out = Path(args.out)
    if not out.is_dir():
        raise UserError(f"--out {out} is not a directory")
    rows = collect(out, parse_layouts(args.layouts), args.optimizers.split(), args.nproc)
    text = markdown(rows)
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps({"nproc": args.nproc, "rows": rows}, indent=1))
    print(text, end="")


if __name__ == "__main__":
    main()
