"""Memory per GPU (and host) of a training job, Megatron's dense Adam baselines vs LoGRA, planned from its flags.

    python tools/plan_memory.py --preset qwen2.5-32b --bf16 --tensor-model-parallel-size 8
    python tools/plan_memory.py --preset qwen2.5-32b --bf16 --gpus 8 --gpu-memory-gib 80 --search --json
    python tools/plan_memory.py --preset qwen2.5-32b --bf16 --gpus 8 --gpu-memory-gib 80 --search \
        --optimizer all --json
    python tools/plan_memory.py --model-config ckpt/model_config.json --bf16 --gpus 8 \\
        --gpu-memory-gib 80 --plot memory.png

Per pipeline stage (its busiest data-parallel rank): the persistent state by component (weights,
fp32 masters, gradient buffers, LoGRA sketches and norm probes, optimizer moments, projections, a
reference model, a colocated rollout engine's weights and KV cache) and the step's transient
peak (activations, logits, temporaries, the KL controller's copies), in GiB.
``--gpus N --gpu-memory-gib G`` says whether each plan fits and with how much headroom;
``--search`` tries every TP x PP x DP layout of the GPUs per optimizer row. ``--optimizer`` picks
the rows (``all``: adam, adam-precision-aware, adam-cpu-offload, adam-8bit, adam-kl, logra;
logra_megatron/planning/settings.py ``ROWS``); every row reports its GPU bytes (``gpu_bytes``, the
busiest GPU), host bytes (``host_bytes`` per rank, ``host_total_bytes`` over the job) and, with
``--gpu-memory-gib``, ``fits``. ``--json`` prints one object (``plans`` or ``search``, one entry per
row under the row's name), ``--plot FILE.png`` draws a stacked bar per GPU (needs matplotlib), ``--validate``
measures a small run against the plan (logra_megatron/planning/validate.py). ``--sequence-parallel``
(TP > 1) plans Megatron's sequence parallelism (logra_megatron/planning/activations.py).
``--overlap-grad-reduce`` (``--ddp-bucket-size``) plans Megatron's buckets, the dense gradient
buffer's and LoGRA's sketch buffer's, each padded under ``--use-distributed-optimizer``;
``--overlap-param-gather`` gathers into the same buffer and changes no byte.
``--num-layers-per-virtual-pipeline-stage`` / ``--num-virtual-stages-per-pipeline-rank`` (checked
as the trainer checks them) plan Megatron's interleaved pipeline: each stage is a pipeline rank
with its chunks, the step replayed in the interleaved schedule's order.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.planning.activations import COMPONENTS as STEP_COMPONENTS  # noqa: E402
from logra_megatron.planning.arguments import (GIB, add_arguments, data_parallel_size, load_model,  # noqa: E402
                                               optimizers_of, settings_from_args)
from logra_megatron.planning.plan import fits, plan_memory, search_layouts  # noqa: E402
from logra_megatron.planning.state import HOST_COMPONENTS, STATE_COMPONENTS, TRANSIENT_COMPONENTS  # noqa: E402
from logra_megatron.rl.packing import default_token_budget  # noqa: E402
from logra_megatron.rollout.engine import ROLLOUT_ENGINES, engine_memory  # noqa: E402

LABELS = {"adam": "dense Adam", "adam-precision-aware": "dense Adam, precision-aware",
          "adam-cpu-offload": "dense Adam, CPU offload", "adam-8bit": "dense Adam, 8-bit moments",
          "adam-kl": "dense Adam under the KL controller", "logra": "LoGRA"}
STEP_PHASES = ("forward_backward", "optimizer", "controller")


def parse_args(argv):
    parser = ArgumentParser(prog="plan_memory", description=__doc__.split("\n\n")[0])
    add_arguments(parser, rollout_engines=ROLLOUT_ENGINES)
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--plot", metavar="FILE.png", help="draw a stacked bar per GPU by component (matplotlib)")
    output.add_argument("--validate", action="store_true",
                        help="measure a small run of these settings and compare it with the plan "
                             "(logra_megatron/planning/validate.py)")
    output.add_argument("--steps", type=int, default=3, help="--validate: optimizer steps of the measured run")
    args = parser.parse_args(argv)
    if args.max_tokens_per_microbatch < 0:
        raise UserError(f"--max-tokens-per-microbatch must be >= 0, got {args.max_tokens_per_microbatch}")
    if not args.max_tokens_per_microbatch:  # 0: the trainer's own default budget (the planner takes it resolved)
        args.max_tokens_per_microbatch = default_token_budget(args.micro_batch_size, args.seq_length)
    args.virtual_pipeline = virtual_pipeline(args)
    # what the engine declares it holds (a package engine's read without importing it)
    args.rollout_engine_memory = engine_memory(args.rollout_engine) if args.rollout_engine else None
    return args


def virtual_pipeline(args):
    """Chunks per pipeline rank from the virtual pipeline flags, checked as the trainer checks
    them (rl/config.py ``ParallelConfig``: not both, PP > 1, a chunk size dividing a stage's
    layers); None without them. (ParallelConfig loads megatron-core: only when a flag is given.)"""
    flags = (args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank)
    if flags == (None, None):
        return None
    if args.search:
        raise UserError("--search does not vary the virtual pipeline: plan a layout (drop --search, or the "
                        "virtual pipeline flag)")
    from logra_megatron.rl.config import ParallelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                              pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              num_layers_per_virtual_pipeline_stage=flags[0], num_virtual_stages_per_pipeline_rank=flags[1])
    return parallel.virtual_pipeline(load_model(args).layers)


def gib(value: int) -> float:
    return value / GIB


def settings_summary(settings) -> dict:
    values = asdict(settings)
    values["model"] = settings.model.to_dict()
    # what the activations were planned on: packed (the trainer's default, SDPA only) or padded
    values["packed"] = settings.packed
    values["tokens_per_microbatch"] = settings.tokens_per_microbatch
    return values


def run_plans(args) -> dict:
    """Every requested optimizer at the layout the flags give."""
    base = settings_from_args(args)
    budget = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
    reserve = int(args.reserve_gib * GIB)
    report = {"settings": settings_summary(base), "gpu_memory_bytes": budget, "reserve_bytes": reserve, "plans": {}}
    for optimizer in optimizers_of(args):
        plan = plan_memory(settings_from_args(args, optimizer))
        entry = dict(plan.to_dict(), row=optimizer)
        if budget is not None:
            entry["fits"], entry["headroom_bytes"] = fits(plan, budget, reserve)
        report["plans"][optimizer] = (plan, entry)
    return report


def run_search(args) -> dict:
    if args.gpus is None or args.gpu_memory_gib is None:
        raise UserError("--search needs --gpus N and --gpu-memory-gib G")
    if args.data_parallel_size is not None:
        raise UserError("--search chooses the data-parallel size itself; drop --data-parallel-size")
    base = settings_from_args(_with(args, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                    data_parallel_size=None, gpus=None))
    budget, reserve = int(args.gpu_memory_gib * GIB), int(args.reserve_gib * GIB)
    choices = search_layouts(base, args.gpus, budget, optimizers_of(args), args.gpus_per_node, reserve,
                             rollout_sequences=args.rollout_sequences)
    report = {"settings": settings_summary(base), "gpus": args.gpus, "gpu_memory_bytes": budget,
              "reserve_bytes": reserve, "rollout_sequences_total": args.rollout_sequences, "search": {}}
    for optimizer, choice in choices.items():
        if choice.plan is None:
            raise UserError(f"no layout of {args.gpus} GPUs can run this model with {optimizer}: "
                            f"{choice.skipped[0]['reason'] if choice.skipped else 'none tried'}")
        entry = choice.to_dict()
        entry["best"]["row"] = optimizer
        report["search"][optimizer] = (choice.plan, entry)
    return report


def _with(args, **changes):
    copy = type(args)(**vars(args))
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy


def json_report(report: dict) -> dict:
    """The report with the plan objects dropped (their dicts are kept)."""
    out = {key: value for key, value in report.items() if key not in ("plans", "search")}
    for key in ("plans", "search"):
        if key in report:
            out[key] = {optimizer: entry for optimizer, (_, entry) in report[key].items()}
    return out


# --- the human table ---------------------------------------------------------------------------------

def _stage_groups(plan):
    """Consecutive stages with identical figures, as ``(label, stage plan)``."""
    groups = []
    for stage in plan.stages:
        if groups and groups[-1][1].state == stage.state and groups[-1][1].step == stage.step:
            groups[-1][2].append(stage.stage)
        else:
            groups.append([None, stage, [stage.stage]])
    return [(f"stage {ids[0]}" if len(ids) == 1 else f"stages {ids[0]}-{ids[-1]}", stage) for _, stage, ids in groups]


def print_plan(optimizer: str, plan, entry: dict, report: dict) -> None:
    layout = entry["layout"]
    chunks = f", {layout['virtual_pipeline']} chunks per rank" if "virtual_pipeline" in layout else ""
    print(f"== {LABELS[optimizer]}: TP {layout['tensor_parallel']} x PP {layout['pipeline_parallel']} x "
          f"DP {layout['data_parallel']} ({layout['gpus']} GPUs{chunks}; distributed optimizer "
          f"{'on' if entry.get('distributed_optimizer') else 'off'}, kl-control {entry.get('kl_control', 'off')}) ==")
    groups = _stage_groups(plan)
    print(f"{'GiB per GPU':<42}" + "".join(f"{label:>14}" for label, _ in groups))
    for key in STATE_COMPONENTS:
        if any(stage.state[key] for _, stage in groups):
            note = " (in peak)" if key in TRANSIENT_COMPONENTS else ""
            print(f"{key + note:<42}" + "".join(f"{gib(stage.state[key]):>14.2f}" for _, stage in groups))
    if any(stage.global_buffer_bytes for _, stage in groups):
        print(f"{'global_buffer_bytes':<42}" + "".join(f"{gib(stage.global_buffer_bytes):>14.2f}" for _, stage in groups))
    print(f"{'persistent':<42}" + "".join(f"{gib(stage.persistent_bytes):>14.2f}" for _, stage in groups))
    print(f"{'peak_step_bytes':<42}" + "".join(f"{gib(stage.peak_step_bytes):>14.2f}" for _, stage in groups))
    for key in STEP_COMPONENTS:  # what is live at the step's peak
        if any(stage.step.get(key) for _, stage in groups):
            print(f"{'  at peak: ' + key:<42}" + "".join(f"{gib(stage.step.get(key, 0)):>14.2f}" for _, stage in groups))
    for phase in STEP_PHASES:
        key = f"{phase}_peak_bytes"
        if any(stage.step.get(key) for _, stage in groups):
            print(f"{'  peak of ' + phase:<42}" + "".join(f"{gib(stage.step.get(key, 0)):>14.2f}" for _, stage in groups))
    print(f"{'total':<42}" + "".join(f"{gib(stage.total_bytes):>14.2f}" for _, stage in groups))
    if any(stage.host_bytes for _, stage in groups):
        for key in HOST_COMPONENTS:
            if any(stage.host.get(key) for _, stage in groups):
                print(f"{key + ' (host)':<42}"
                      + "".join(f"{gib(stage.host.get(key, 0)):>14.2f}" for _, stage in groups))
        print(f"{'host memory per GPU':<42}" + "".join(f"{gib(stage.host_bytes):>14.2f}" for _, stage in groups))
        print(f"host memory of the job: {gib(entry['host_total_bytes']):.2f} GiB over {layout['gpus']} GPUs")
    if "fits" in entry:
        budget, reserve = report["gpu_memory_bytes"], report["reserve_bytes"]
        verdict = "fits" if entry["fits"] else "does NOT fit"
        print(f"{verdict} in {gib(budget):.0f} GiB per GPU ({gib(reserve):.0f} GiB reserved): "
              f"headroom {gib(entry['headroom_bytes']):.2f} GiB on the busiest GPU (stage {plan.busiest.stage})")
    print()


def print_header(report: dict) -> None:
    s = report["settings"]
    model = s["model"]
    logra = s["logra"]
    rollout = s["rollout"]
    print(f"model: hidden {model['hidden']}, {model['layers']} layers, {model['heads']}/{model['kv_heads']} heads, "
          f"ffn {model['ffn_hidden']}, vocab {model['vocab']}{', tied' if model['tie_embeddings'] else ''}; "
          f"{'bf16' if s['bf16'] else 'fp32'}; distributed optimizer {'on' if s['distributed_optimizer'] else 'off'}"
          f"{'; sequence parallel (where TP > 1)' if s['sequence_parallel'] else ''}")
    print(f"LoGRA: rank {logra['rank']}, master {logra['master']}, embeddings "
          f"{'sketched' if logra['embeddings'] else 'dense'}, {logra['norm_probes']} norm probes; "
          f"kl-control {s['kl_control']}; "
          + (f"packed microbatches of {s['tokens_per_microbatch']} tokens (rows of {s['seq_length']}), "
             if s["packed"] else f"micro-batch {s['micro_batch_size']} x {s['seq_length']} tokens, ") +
          f"global batch {s['global_batch_size']}; recompute {s['recompute_granularity']}; "
          f"reference model {'yes' if s['reference_model'] else 'no'}")
    if report.get("rollout_sequences_total"):
        print(f"rollout: {report['rollout_sequences_total']} sequences over all replicas x "
              f"{rollout['max_tokens']} tokens, engine weights {'separate' if rollout['engine']['own_weights'] else 'shared'}")
    elif rollout["sequences_in_flight"]:
        print(f"rollout: {rollout['sequences_in_flight']} sequences per replica x {rollout['max_tokens']} tokens, "
              f"engine weights {'separate' if rollout['engine']['own_weights'] else 'shared'}")
    print()


def print_report(report: dict) -> None:
    print_header(report)
    if "search" in report:
        for optimizer, (plan, entry) in report["search"].items():
            print(f"-- {LABELS[optimizer]}: layouts of {report['gpus']} GPUs, least memory first --")
            print(f"{'TP':>4}{'PP':>4}{'DP':>4}{'GiB per GPU':>14}{'host GiB':>10}{'headroom':>12}  fits")
            for row in entry["candidates"]:
                print(f"{row['tensor_parallel']:>4}{row['pipeline_parallel']:>4}{row['data_parallel']:>4}"
                      f"{gib(row['total_per_gpu_bytes']):>14.2f}{gib(row['host_bytes']):>10.2f}"
                      f"{gib(row['headroom_bytes']):>12.2f}  {'yes' if row['fits'] else 'no'}")
            for row in entry["skipped"]:
                print(f"{row['tensor_parallel']:>4}{row['pipeline_parallel']:>4}{row['data_parallel']:>4}  skipped: {row['reason']}")
            print()
            print_plan(optimizer, plan, entry["best"], report)
    else:
        for optimizer, (plan, entry) in report["plans"].items():
            print_plan(optimizer, plan, entry, report)


# --- the plot ----------------------------------------------------------------------------------------

def plot(report: dict, path: str) -> None:
    """A stacked bar per pipeline stage (one GPU of it) and optimizer, by component."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = report.get("search") or report["plans"]
    bars = []
    for optimizer, (plan, _) in plans.items():
        s = plan.settings
        for stage in plan.stages:
            label = f"{LABELS[optimizer]}\nTP{s.tensor_parallel} PP{s.pipeline_parallel} DP{s.data_parallel}"
            if s.pipeline_parallel > 1:
                label += f"\nstage {stage.stage}"
            parts = {key: value for key, value in stage.state.items() if key not in TRANSIENT_COMPONENTS}
            parts["global_buffer_bytes"] = stage.global_buffer_bytes
            parts["peak_step_bytes"] = stage.peak_step_bytes
            bars.append((label, parts))
    keys = [key for key in (*STATE_COMPONENTS, "global_buffer_bytes", "peak_step_bytes")
            if any(parts.get(key) for _, parts in bars)]
    figure, axis = plt.subplots(figsize=(max(6.0, 1.3 * len(bars) + 2), 5))
    bottoms = [0.0] * len(bars)
    colors = plt.get_cmap("tab10")
    for index, key in enumerate(keys):
        heights = [gib(parts.get(key, 0)) for _, parts in bars]
        axis.bar(range(len(bars)), heights, bottom=bottoms, label=key.replace("_bytes", ""), color=colors(index % 10))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if report.get("gpu_memory_bytes"):
        axis.axhline(gib(report["gpu_memory_bytes"]), color="black", linestyle="--", linewidth=1,
                     label=f"GPU memory ({gib(report['gpu_memory_bytes']):.0f} GiB)")
    axis.set_xticks(range(len(bars)))
    axis.set_xticklabels([label for label, _ in bars], fontsize=8)
    axis.set_ylabel("GiB per GPU")
    axis.set_title(f"memory per GPU: hidden {report['settings']['model']['hidden']}, "
                   f"{report['settings']['model']['layers']} layers")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise UserError(f"cannot write --plot {path}: {error.strerror}") from None
    finally:
        plt.close(figure)


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.validate:
        from logra_megatron.planning.validate import main_validate  # builds models: loads megatron-core

        status = main_validate(args)  # 1: a measured figure is outside its bound
        if status:
            sys.exit(status)
        return
    if args.search:
        report = run_search(args)
    else:
        data_parallel_size(args)
        report = run_plans(args)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(json_report(report)))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
