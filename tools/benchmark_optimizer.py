"""The planner's optimizer rows on the same model, data and seed, in one run: memory measured.

    python tools/benchmark_optimizer.py --preset tiny --logra-rank 16 --steps 5 --json
    python tools/benchmark_optimizer.py --preset smollm2-135m --logra-rank 64 --bf16 \\
        --kl-control probe --logra-embeddings --logra-master fp32 --steps 3 --json

The rows are the planner's (``tools/plan_memory.py --optimizer all``;
``logra_megatron/planning/settings.py: ROWS``), built as ``tools/_baseline_rows.py`` says:
``adam`` (plain Megatron Adam as users run it: with ``--bf16`` bf16 weights, fp32 grads, fp32
masters, Adam moments, 18 bytes/param; no KL controller), ``adam-precision-aware``
(``use_precision_aware_optimizer``), ``adam-cpu-offload`` (``optimizer_cpu_offload``,
``--optimizer-offload-fraction``), ``adam-8bit`` (bitsandbytes' block-wise 8-bit moments inside
Megatron's optimizer), ``adam-kl`` (dense Adam under our KL controller) and ``logra`` (the LoGRA
flags and ``--kl-control`` apply to it). ``--rows`` picks some (default: all). Each row runs in
its own child process. A row that cannot run here (on a machine without CUDA:
``adam-precision-aware``, which megatron-core 0.16.1 builds only with Transformer Engine, and
``adam-cpu-offload``, whose optimizer needs CUDA) is kept, ``"status": "unavailable"`` with the
reason and its measured figures ``null``.

Measured on each row after the last step, from the live tensors (each storage counted once):
``weight_bytes``, ``master_bytes``, ``grad_bytes`` (dense grad buffers), ``sketch_bytes``
(sketches and norm probes), ``moment_bytes`` (optimizer state), ``projection_bytes``,
``controller_extra_bytes`` (what the KL controller held during the step), their sum
``training_state_bytes``; ``peak_step_bytes``, the peak of tracked tensor allocations during the
last step beyond what was live before it (activations, temporaries; ``torch.cuda``'s peak on a
GPU); ``peak_rss_untracked_bytes`` (the process's peak RSS, an extra figure: over its start,
the build and the untracked steps, read before the tracked step, whose profiler would add its
own records; on a GPU ``torch.cuda``'s peak allocation up to then), ``host_rss_bytes`` and
``host_peak_rss_bytes`` (the process's resident memory at the end and its peak, the host's
figure), ``offloaded_state_bytes`` (optimizer state in host memory while the model is on a GPU:
CPU offload's masters, moments and pinned gradients; 0 on a CPU run, where all is host),
``step_time_s`` (median, untracked steps), ``dp_comm_bytes_per_step`` (planned), ``final_loss``
and ``main_tensor_numels`` (the elements of each tensor the dense optimizer updates, for the
bytes by hand). Beside them ``planned``: the planner's bytes for the same row and settings
(``logra_megatron/planning/state.py: stage_state``, TP = PP = DP = 1), by its components, GPU
and host. The parent prints a table, or with ``--json`` one object: the settings, ``rows``
(one object per row under :data:`ROW_KEYS`), ``dense`` and ``logra`` (the ``adam`` and
``logra`` rows' figures under :data:`SIDE_KEYS`), ``ratio`` (logra / dense of each figure) and ``ratio_to_adam`` (each row over
``adam``).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.logra.config import LogRAConfig, add_rank_arguments  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig  # noqa: E402
from logra_megatron.schema import add_flags  # noqa: E402
from logra_megatron.training.config import KLControlConfig  # noqa: E402
from _bench_common import (COMPONENTS, measure_components, validate_benchmark_args,  # noqa: E402
                           run_json_child, run_steps)

ROWS = ("adam", "adam-precision-aware", "adam-cpu-offload", "adam-8bit", "adam-kl", "logra")
"""The planner's rows (``logra_megatron/planning/settings.py: ROWS``, the same names; a test keeps
them equal), in the order they run."""
METRICS = COMPONENTS + ("training_state_bytes", "peak_step_bytes", "peak_rss_untracked_bytes", "step_time_s",
                        "dp_comm_bytes_per_step", "final_loss")
EXTRA_METRICS = ("cuda_max_memory_allocated_bytes", "host_rss_bytes", "host_peak_rss_bytes",
                 "offloaded_state_bytes", "main_tensor_numels")
SIDE_KEYS = METRICS + ("cuda_max_memory_allocated_bytes",)
"""The keys of ``dense`` and ``logra``, the report's two sides (the ``adam`` and ``logra`` rows)."""
ROW_KEYS = ("row", "status", "reason", "kl_control", "distributed_optimizer") + METRICS + EXTRA_METRICS + (
    "planned",)
"""Every row's keys, measured or not (a row that cannot run has its figures ``null``)."""
PLANNED_KEYS = ("weight_bytes", "master_bytes", "grad_bytes", "sketch_bytes", "norm_probe_bytes", "moment_bytes",
                "projection_bytes", "controller_extra_bytes", "training_state_bytes", "host_master_bytes",
                "host_grad_bytes", "host_moment_bytes", "host_state_bytes")
"""The planner's figures of a row (its GPU components, the sum of those the benchmark measures,
its host components and theirs)."""


def parse_args(argv):
    from logra_megatron.planning.arguments import add_baseline_arguments

    parser = ArgumentParser(prog="benchmark_optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    add_rank_arguments(parser)
    add_flags(parser, LogRAConfig, "refresh_interval", "master", "embeddings")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (every row)")
    add_flags(parser, ModelSourceConfig, "attention_backend")
    # Memory as users run each optimizer: no KL controller unless asked (LoGRA's; adam-kl's).
    add_flags(parser, KLControlConfig, "mode", defaults={"mode": "off"})
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="Megatron's distributed optimizer and LoGRA's ZeRO-1 mode on every row "
                             "(adam-precision-aware and adam-cpu-offload always use it)")
    parser.add_argument("--rows", default="all",
                        help=f"comma-separated rows to run, of {', '.join(ROWS)}; default all")
    add_baseline_arguments(parser)
    parser.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                        help="adam-cpu-offload: overlap the host optimizer's copies with compute (Megatron's flag)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=ROWS, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def selected_rows(args) -> list:
    """The rows ``--rows`` names, in :data:`ROWS` order."""
    if args.rows == "all":
        return list(ROWS)
    names = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROWS]
    if unknown or not names:
        raise UserError(f"--rows must name rows of {', '.join(ROWS)} (or all), got {args.rows!r}")
    return [row for row in ROWS if row in names]


def validate(args):
    """Fail fast, in the parent, on bad input."""
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise UserError(f"--optimizer-offload-fraction must be in [0, 1], got {args.optimizer_offload_fraction}")
    selected_rows(args)
    return validate_benchmark_args(args)


def planned_bytes(args, row: str) -> dict:
    """The planner's bytes for ``row`` at these settings (TP = PP = DP = 1), under
    :data:`PLANNED_KEYS`."""
    from logra_megatron.planning.settings import PlanSettings, settings_for_row
    from logra_megatron.planning.state import HOST_COMPONENTS, stage_state

    model, logra = validate_benchmark_args(args)
    settings = PlanSettings(
        model=model, bf16=args.bf16, logra=logra, kl_control=args.kl_control,
        distributed_optimizer=args.use_distributed_optimizer, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        attention_backend=args.attention_backend, exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype, optimizer_offload_fraction=args.optimizer_offload_fraction)
    gpu, host = stage_state(settings_for_row(settings, row), 0, with_host=True)
    planned = {key: gpu.get(key, 0) for key in PLANNED_KEYS[:8]}
    # Summed as the benchmark sums what it measures (:data:`COMPONENTS`: the norm probes'
    # directions are not among them; the controller's copies, transient in the planner, are
    # what the controller held during the step).
    planned["training_state_bytes"] = sum(planned[key] for key in COMPONENTS)
    planned.update({key: host[key] for key in HOST_COMPONENTS})
    planned["host_state_bytes"] = sum(host[key] for key in HOST_COMPONENTS)
    return planned


def unavailable_row(row: str, args, reason: str) -> dict:
    from _baseline_rows import controller_mode, uses_distributed_optimizer

    return {"row": row, "status": "unavailable", "reason": reason, "kl_control": controller_mode(row, args),
            "distributed_optimizer": uses_distributed_optimizer(row, args),
            **dict.fromkeys(METRICS + EXTRA_METRICS)}


def run_child(args) -> dict:
    import torch

    from _baseline_rows import (MAY_FAIL_HERE, RowUnavailable, build_row, controller_mode, unavailable,
                                uses_distributed_optimizer)
    from logra_megatron import parallel
    from logra_megatron.logra.accounting import state_bytes
    from logra_megatron.models.build import model_device
    from logra_megatron.optim.megatron_internals import main_param_groups
    from logra_megatron.platform import cuda_available
    from logra_megatron.training.config import KLControlConfig
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.measure import dense_state_by_device, host_rss_bytes

    row = args.child
    model_config, logra_config = validate(args)
    parallel.initialize(1, 1, seed=args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    try:
        model, ddp, optimizer = build_row(row, args, model_config, logra_config, dtype)
    except RowUnavailable as why:
        return unavailable_row(row, args, str(why))
    # Token ids drawn on the CPU on purpose (the same batch on every device kind), moved once.
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator)
    per = args.global_batch_size // parallel.dp_size()
    mine = tokens[parallel.dp_rank() * per:(parallel.dp_rank() + 1) * per].to(model_device(model))
    controller = PredictedKLController(KLControlConfig(mode=controller_mode(row, args), realized_interval=0))
    probe_rows = mine[:min(2, len(mine))]
    probe = ProbeSet(probe_rows, torch.ones_like(probe_rows, dtype=torch.float), micro_batch_size=1)

    def step():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = lm_forward_backward(ddp, mine, args.micro_batch_size)
        return loss, controller.step(ddp, optimizer, probe)

    # ``--steps`` untracked steps (the first, which allocates the optimizer's state, not timed),
    # then one more, tracked (the profiler slows it).
    try:
        _, (loss, control), seconds, tracked, untracked_peak = run_steps(step, args.steps + 1)
    except Exception as error:
        if row not in MAY_FAIL_HERE:
            raise
        return unavailable_row(row, args, str(unavailable(row, error, "its first step")))
    components = measure_components(model, ddp, optimizer, control["controller_extra_bytes"])
    on_gpu = model_device(model).type == "cuda"
    mains = [p for part in optimizer.dense for group in main_param_groups(part) for p in group]
    by_device = dense_state_by_device(optimizer, counted=[*model.parameters(), *mains])
    if row != "logra":
        # The dense optimizer's state, each storage once (bitsandbytes' quantization maps are shared
        # by all its parameters); state kept on the host beside a GPU model is the offload's.
        components["moment_bytes"] = sum(by_device.values()) - (by_device.get("cpu", 0) if on_gpu else 0)
    planned = state_bytes(model, logra_config)["logra" if row == "logra" else "dense"]
    return {
        "row": row, "status": "measured", "reason": None, "kl_control": controller_mode(row, args),
        "distributed_optimizer": uses_distributed_optimizer(row, args),
        **components,
        "training_state_bytes": sum(components.values()),
        "peak_step_bytes": tracked.peak_bytes,
        "peak_rss_untracked_bytes": untracked_peak,
        "step_time_s": seconds,
        "dp_comm_bytes_per_step": planned.dp_comm_bytes_per_step,
        "final_loss": loss,
        # CUDA's own high-water mark of the whole run (state + every step), beside the components.
        "cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda_available() else None,
        **host_rss_bytes(),
        "offloaded_state_bytes": by_device.get("cpu", 0) if on_gpu else 0,
        "main_tensor_numels": [p.numel() for p in mains],
    }


def ratios(row: dict, base: dict) -> dict:
    return {key: (row[key] / base[key] if row[key] is not None and base[key] else None) for key in METRICS}


def run_parent(args) -> dict:
    validate(args)
    rows = {}
    for row in selected_rows(args):
        if not args.json:
            print(f"[benchmark] running {row} ({args.steps} steps + 1 tracked) ...", file=sys.stderr, flush=True)
        result = run_json_child([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", row], row)
        rows[row] = {key: result.get(key) for key in ROW_KEYS[:-1]}
        rows[row]["planned"] = planned_bytes(args, row)
    settings = {"preset": args.preset, "rank": args.logra_rank, "max_rank": args.logra_max_rank,
                "steps": args.steps, "bf16": args.bf16,
                "attention_backend": args.attention_backend,
                "kl_control": args.kl_control, "logra_embeddings": args.logra_embeddings,
                "logra_master": args.logra_master, "use_distributed_optimizer": args.use_distributed_optimizer,
                "exp_avg_dtype": args.exp_avg_dtype, "exp_avg_sq_dtype": args.exp_avg_sq_dtype,
                "optimizer_offload_fraction": args.optimizer_offload_fraction,
                "overlap_cpu_optimizer_d2h_h2d": args.overlap_cpu_optimizer_d2h_h2d}
    report = {**settings, "rows": rows}
    if "adam" in rows:
        report["ratio_to_adam"] = {row: ratios(rows[row], rows["adam"]) for row in rows}
    if "adam" in rows and "logra" in rows:
        # The two sides under the keys they have always had (tools/gpu_check.py and older readers).
        report.update(dense={key: rows["adam"][key] for key in SIDE_KEYS},
                      logra={key: rows["logra"][key] for key in SIDE_KEYS}, ratio=ratios(rows["logra"], rows["adam"]))
    return report


def print_table(report):
    rows = report["rows"]
    print(f"preset {report['preset']}  logra rank {report['rank']} (at most {report['max_rank']})  "
          f"steps {report['steps']}  "
          f"{'bf16' if report['bf16'] else 'fp32'}  kl-control {report['kl_control']}  "
          f"master {report['logra_master']}  embeddings {'sketched' if report['logra_embeddings'] else 'dense'}")
    print(f"{'metric':<26}" + "".join(f"{name:>22}" for name in rows))
    for key in METRICS + ("host_peak_rss_bytes", "offloaded_state_bytes"):
        cells = ["-" if rows[name][key] is None else f"{rows[name][key]:.6g}" for name in rows]
        print(f"{key:<26}" + "".join(f"{cell:>22}" for cell in cells))
    for key in ("training_state_bytes", "host_state_bytes"):
        print(f"{'planned ' + key:<26}" + "".join(f"{rows[name]['planned'][key]:>22.6g}" for name in rows))
    for name, row in rows.items():
        if row["status"] != "measured":
            print(f"{name}: {row['status']}: {row['reason']}")


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
