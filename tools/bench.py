"""The benchmarks, one entry: ``python tools/bench.py <row> [the row's flags]``.

Each row is one module beside this file, run as if it were called directly (``--help`` after the
row name shows its flags); the rows that compare optimizers run each side in a child process
through ``_bench_common.py: run_json_child`` (the one child-process harness), so one side's
allocations never show up in another's figures. Every row prints a table, or with ``--json`` one
JSON object, with the dense baseline beside LoGRA in the same run.

    optimizer           dense Adam vs LoGRA: training state by component, peak, step time
    step-phases         dense Adam vs LoGRA step time phase by phase; the KL controller's share
    peers               LoGRA beside Megatron Adam, torch AdamW, GaLore, APOLLO, RowAdam
    policy-sync         full vs low-rank weight sync into the vLLM engine
    packing             one GRPO step on a ragged batch, padded vs packed
    single-gpu-rl-step  the largest preset the planner fits on one GPU takes RL-shaped steps
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

ROWS = {
    "optimizer": "benchmark_optimizer.py",
    "step-phases": "benchmark_step_phases.py",
    "peers": "benchmark_peers.py",
    "policy-sync": "benchmark_policy_sync.py",
    "packing": "benchmark_packing.py",
    "single-gpu-rl-step": "single_gpu_rl_step.py",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    row, rest = argv[0], argv[1:]
    if row not in ROWS:
        print(f"error: no benchmark row {row!r}; the rows: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    script = HERE / ROWS[row]
    # The row runs as its own script: its parent/child re-invocation (sys.argv, __file__) and its
    # exit status are exactly those of `python tools/<script> ...`.
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
