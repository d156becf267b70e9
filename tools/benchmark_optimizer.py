"""Megatron dense Adam vs LoGRA on the same model, data and seed, in one run.

    python tools/benchmark_optimizer.py --preset tiny --logra-rank 16 --steps 5 --json

Each optimizer runs in its own child process (so each peak RSS is that optimizer's alone);
the parent prints a table, or with ``--json`` one JSON object:
``{"preset", "rank", "dense": {...}, "logra": {...}, "ratio": {...}}`` where each side has
``grad_bytes``, ``optimizer_state_bytes``, ``peak_rss_bytes`` (``torch.cuda.max_memory_allocated``
on GPU), ``step_time_s`` (median), ``dp_comm_bytes_per_step`` and ``final_loss``; ``ratio`` is
logra / dense of each.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402

METRICS = ("grad_bytes", "optimizer_state_bytes", "peak_rss_bytes", "step_time_s",
           "dp_comm_bytes_per_step", "final_loss")


def parse_args(argv):
    parser = ArgumentParser(prog="benchmark_optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--logra-rank", default="0.25", help="integer rank or fraction (default 0.25)")
    parser.add_argument("--logra-refresh-interval", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=("adam", "logra"), help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def validate(args):
    """Fail fast, in the parent, on bad input."""
    from logra_megatron.logra import LogRAConfig, parse_rank
    from logra_megatron.models import get_preset

    model = get_preset(args.preset)
    logra = LogRAConfig(rank=parse_rank(args.logra_rank), refresh_interval=args.logra_refresh_interval)
    logra.check_model(model)
    if args.global_batch_size % args.micro_batch_size:
        raise UserError("--global-batch-size must be a multiple of --micro-batch-size")
    if args.seq_length + 1 > model.max_seq:
        raise UserError(f"--seq-length exceeds the model's max_seq {model.max_seq}")
    return model, logra


def run_child(args) -> dict:
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra.accounting import state_bytes
    from logra_megatron.platform import cuda_available
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.setup import build_trainable, train_step

    model_config, logra_config = validate(args)
    parallel.initialize(1, 1, seed=args.seed)
    model, ddp, optimizer = build_trainable(
        model_config, OptimizerSettings(kind=args.child, lr=args.lr, clip_grad=1.0), logra_config)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator)
    times, loss = [], None
    for step in range(args.steps + 1):
        start = time.perf_counter()
        loss, _ = train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, args.micro_batch_size))
        if step > 0:  # the first step allocates Adam's state: a warm-up, not timed
            times.append(time.perf_counter() - start)
    measured = optimizer.state_bytes()  # what this rank actually allocated
    planned = state_bytes(model, logra_config)["logra" if args.child == "logra" else "dense"]
    if cuda_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "grad_bytes": measured["grad_bytes"],
        "optimizer_state_bytes": measured["optimizer_state_bytes"] + measured["projection_bytes"],
        "peak_rss_bytes": peak,
        "step_time_s": statistics.median(times),
        "dp_comm_bytes_per_step": planned.dp_comm_bytes_per_step,
        "final_loss": loss,
    }


def run_parent(args) -> dict:
    validate(args)
    results = {}
    for kind in ("adam", "logra"):
        if not args.json:
            print(f"[benchmark] running {kind} ({args.steps} steps) ...", file=sys.stderr, flush=True)
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", kind],
            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
        if child.returncode != 0:
            raise UserError(f"the {kind} run failed:\n{child.stderr[-3000:]}")
        results["dense" if kind == "adam" else "logra"] = json.loads(child.stdout.strip().splitlines()[-1])
    ratio = {key: (results["logra"][key] / results["dense"][key] if results["dense"][key] else None)
             for key in METRICS}
    return {"preset": args.preset, "rank": args.logra_rank, "steps": args.steps,
            "dense": results["dense"], "logra": results["logra"], "ratio": ratio}


def print_table(report):
    print(f"preset {report['preset']}  logra rank {report['rank']}  steps {report['steps']}")
    print(f"{'metric':<26}{'dense adam':>16}{'logra':>16}{'logra/dense':>14}")
    for key in METRICS:
        dense, logra, ratio = report["dense"][key], report["logra"][key], report["ratio"][key]
        print(f"{key:<26}{dense:>16.6g}{logra:>16.6g}{ratio:>14.3f}")


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    report = run_parent(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
