"""Megatron dense Adam vs LoGRA on the same model, data and seed, in one run: memory measured.

    python tools/benchmark_optimizer.py --preset tiny --logra-rank 16 --steps 5 --json
    python tools/benchmark_optimizer.py --preset smollm2-135m --logra-rank 64 --bf16 \\
        --kl-control probe --logra-embeddings --logra-master fp32 --steps 3 --json

Each optimizer runs in its own child process. The dense side is plain Megatron Adam (with
``--bf16``: bf16 weights, fp32 grads, fp32 masters, Adam moments: 18 bytes/param); the LoGRA
flags and ``--kl-control`` apply to the LoGRA side (its controller's extra memory is counted).
Measured on each side after the last step, from the live tensors (each storage counted once):
``weight_bytes``, ``master_bytes``, ``grad_bytes`` (dense grad buffers), ``sketch_bytes``
(sketches and norm probes), ``moment_bytes`` (optimizer state), ``projection_bytes``,
``controller_extra_bytes`` (what the KL controller held during the step), their sum
``training_state_bytes``; ``peak_step_bytes``, the peak of tracked tensor allocations during the
last step beyond what was live before it (activations, temporaries; ``torch.cuda``'s peak on a
GPU); ``peak_rss_untracked_bytes`` (the process's peak RSS, an extra figure: over its start,
the build and the untracked steps, read before the tracked step, whose profiler would add its
own records; on a GPU ``torch.cuda``'s peak allocation up to then), ``step_time_s`` (median,
untracked steps), ``dp_comm_bytes_per_step`` (planned) and ``final_loss``. The parent prints a table, or
with ``--json`` one object ``{"preset", "rank", ..., "dense", "logra", "ratio"}`` where
``ratio`` is logra / dense of each figure.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import exit_on_user_error  # noqa: E402
from logra_megatron.logra.config import LogRAConfig, add_rank_arguments  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig  # noqa: E402
from logra_megatron.schema import add_flags  # noqa: E402
from logra_megatron.training.config import KLControlConfig  # noqa: E402
from _bench_common import (COMPONENTS, measure_components, validate_benchmark_args,  # noqa: E402
                           run_json_child, run_steps)

METRICS = COMPONENTS + ("training_state_bytes", "peak_step_bytes", "peak_rss_untracked_bytes", "step_time_s",
                        "dp_comm_bytes_per_step", "final_loss")


def parse_args(argv):
    parser = ArgumentParser(prog="benchmark_optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    add_rank_arguments(parser)
    add_flags(parser, LogRAConfig, "refresh_interval", "master", "embeddings")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (both sides)")
    add_flags(parser, ModelSourceConfig, "attention_backend")
    # Memory as users run each optimizer: no KL controller unless asked (on the LoGRA side).
    add_flags(parser, KLControlConfig, "mode", defaults={"mode": "off"})
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="Megatron's distributed optimizer and LoGRA's ZeRO-1 mode on both sides")
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
    return validate_benchmark_args(args)


def run_child(args) -> dict:
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra.accounting import state_bytes
    from logra_megatron.training.config import KLControlConfig, OptimizerSettings
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.models.build import model_device
    from logra_megatron.platform import cuda_available
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable

    model_config, logra_config = validate(args)
    parallel.initialize(1, 1, seed=args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model, ddp, optimizer = build_trainable(
        model_config, OptimizerSettings(kind=args.child, lr=args.lr, clip_grad=1.0,
                                        distributed=args.use_distributed_optimizer),
        logra_config, dtype=dtype, seed=args.seed, attention_backend=args.attention_backend)
    # Token ids drawn on the CPU on purpose (the same batch on every device kind), moved once.
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator)
    per = args.global_batch_size // parallel.dp_size()
    mine = tokens[parallel.dp_rank() * per:(parallel.dp_rank() + 1) * per].to(model_device(model))
    mode = args.kl_control if args.child == "logra" else "off"
    controller = PredictedKLController(KLControlConfig(mode=mode, realized_interval=0))
    probe_rows = mine[:min(2, len(mine))]
    probe = ProbeSet(probe_rows, torch.ones_like(probe_rows, dtype=torch.float), micro_batch_size=1)

    def step():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = lm_forward_backward(ddp, mine, args.micro_batch_size)
        return loss, controller.step(ddp, optimizer, probe)

    # ``--steps`` untracked steps (the first, which allocates Adam's state, not timed), then one
    # more, tracked (the profiler slows it).
    _, (loss, control), seconds, tracked, untracked_peak = run_steps(step, args.steps + 1)
    components = measure_components(model, ddp, optimizer, control["controller_extra_bytes"])
    planned = state_bytes(model, logra_config)["logra" if args.child == "logra" else "dense"]
    return {
        **components,
        "training_state_bytes": sum(components.values()),
        "peak_step_bytes": tracked.peak_bytes,
        # CUDA's own high-water mark of the whole run (state + every step), beside the components.
        "cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda_available() else None,
        "peak_rss_untracked_bytes": untracked_peak,
        "step_time_s": seconds,
        "dp_comm_bytes_per_step": planned.dp_comm_bytes_per_step,
        "final_loss": loss,
    }


def run_parent(args) -> dict:
    validate(args)
    results = {}
    for kind in ("adam", "logra"):
        if not args.json:
            print(f"[benchmark] running {kind} ({args.steps} steps + 1 tracked) ...", file=sys.stderr, flush=True)
        results["dense" if kind == "adam" else "logra"] = run_json_child(
            [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", kind], kind)
    ratio = {key: (results["logra"][key] / results["dense"][key] if results["dense"][key] else None)
             for key in METRICS}
    settings = {"preset": args.preset, "rank": args.logra_rank, "max_rank": args.logra_max_rank,
                "steps": args.steps, "bf16": args.bf16,
                "attention_backend": args.attention_backend,
                "kl_control": args.kl_control, "logra_embeddings": args.logra_embeddings,
                "logra_master": args.logra_master, "use_distributed_optimizer": args.use_distributed_optimizer}
    return {**settings, "dense": results["dense"], "logra": results["logra"], "ratio": ratio}


def print_table(report):
    print(f"preset {report['preset']}  logra rank {report['rank']} (at most {report['max_rank']})  "
          f"steps {report['steps']}  "
          f"{'bf16' if report['bf16'] else 'fp32'}  kl-control {report['kl_control']}  "
          f"master {report['logra_master']}  embeddings {'sketched' if report['logra_embeddings'] else 'dense'}")
    print(f"{'metric':<26}{'dense adam':>16}{'logra':>16}{'logra/dense':>14}")
    for key in METRICS:
        dense, logra, ratio = report["dense"][key], report["logra"][key], report["ratio"][key]
        shown = "-" if ratio is None else f"{ratio:.3f}"
        print(f"{key:<26}{dense:>16.6g}{logra:>16.6g}{shown:>14}")


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
