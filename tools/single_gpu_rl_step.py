"""The single-GPU verdict, measured: the largest model the planner says fits one GPU takes
RL-shaped steps there, and the measured peak stands beside the plan.

Each step is what the trainer's GRPO step does, on synthetic prompts and rewards (the step's
memory and time do not depend on what the tokens mean): a Megatron-engine rollout of
``--rollout-sequences`` sequences with the KV cache, the old-policy log-probs, the policy-loss
backward (sketches written in the backward), the KL probe forecast and the commit. The model is
LoGRA with bf16 weights and ``--logra-master bf16-sr`` (no fp32 master), sketched embeddings,
fresh weights drawn on the device.

``--preset auto`` (default) asks the planner, from the largest preset down, for the first that
fits LoGRA on this GPU (``--gpu-memory-gib``, default: the device's), without recomputation or
with full recomputation of every layer. The report holds the plan's total (state + step peak)
beside CUDA's ``max_memory_allocated`` (on the CPU: the live state plus the peak of tracked
allocations), and the planner's dense-Adam verdict for the same job.

    python tools/single_gpu_rl_step.py --json                  # on a GPU
    python tools/single_gpu_rl_step.py --preset tiny --seq-length 64 --rollout-max-tokens 8 --json
"""

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.models.config import PRESETS  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig, RolloutConfig, RunConfig  # noqa: E402
from logra_megatron.schema import add_flags, validate_flags  # noqa: E402
from logra_megatron.training.config import KLControlConfig  # noqa: E402
from _bench_common import run_json_child  # noqa: E402

GIB = 1 << 30
AUTO = "auto"
"""``--preset auto``: the largest preset whose LoGRA plan fits the GPU."""
LARGEST_FIRST = ("qwen2.5-32b", "gemma-2-27b", "mistral-small-24b", "llama3-8b", "qwen2.5-7b",
                 "qwen2.5-1.5b", "qwen2.5-0.5b", "smollm2-135m", "tiny")
RECOMPUTE_CHOICES = ((), ("--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"))
SPARE_FRACTION = 0.10
"""Without recomputation a plan must leave this share of the GPU spare (the allocator's
fragmentation and what the plan does not model); otherwise every layer is recomputed."""


def build_parser():
    parser = ArgumentParser(prog="single_gpu_rl_step", description=__doc__.split("\n\n")[0])
    # --preset auto: the planner's choice, beside the schema's presets (checked in parse_args).
    add_flags(parser, ModelSourceConfig, "preset", defaults={"preset": AUTO},
              notes={"preset": f"{AUTO}: the largest preset the planner fits on this GPU"})
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of the GPU to plan for (default: this device's; 141 on the CPU)")
    # An RL rollout of the shapes a single-GPU run of the largest presets takes: 2048 tokens of
    # prompt + response (the trainer's default is the model's own max sequence length).
    add_flags(parser, RolloutConfig, "seq_length", defaults={"seq_length": 2048},
              notes={"seq_length": "2048 tokens of prompt + new tokens"})
    # The planner's names (tools/plan_memory.py) for the rollout's shape.
    parser.add_argument("--rollout-sequences", type=int, default=4, help="sequences per rollout (2 prompts x G)")
    parser.add_argument("--rollout-max-tokens", type=int, default=32, help="new tokens per sequence")
    # Probe rows are taken from the rollout of --rollout-sequences (4): the trainer's 8 would not fit.
    add_flags(parser, KLControlConfig, "probe_sequences", defaults={"probe_sequences": 2})
    parser.add_argument("--steps", type=int, default=2, help="RL-shaped steps (0: build only, timed)")
    add_flags(parser, RunConfig, "seed")
    parser.add_argument("--plan-table", action="store_true",
                        help="no model: the planner's verdicts, preset by preset, for one 80 GiB and one 141 GiB "
                             "GPU (markdown; JSON with --json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset != AUTO and args.preset not in PRESETS:
        raise UserError(f"unknown model preset {args.preset!r}; choose {AUTO} or one of: {', '.join(PRESETS)}")
    validate_flags(parser, args, skip=("--preset",))
    if args.steps < 0:
        raise UserError("--steps must be >= 0")
    if args.rollout_sequences % 2 or args.rollout_sequences < 2:
        raise UserError("--rollout-sequences must be an even number >= 2 (prompts x 2 samples)")
    if args.rollout_max_tokens >= args.seq_length:
        raise UserError("--rollout-max-tokens must be below --seq-length (the prompt fills the rest)")
    return args


def plan_flags(args, preset: str, recompute: tuple, gpu_memory_gib: float) -> list:
    """The planner's flags for this job (the same layout, precision, rollout and probe)."""
    return ["--preset", preset, "--bf16", "--gpus", "1", "--gpu-memory-gib", str(gpu_memory_gib),
            "--logra-master", "bf16-sr", "--logra-embeddings", "--kl-control", "probe",
            "--kl-probe-sequences", str(args.kl_probe_sequences), "--micro-batch-size", "1",
            "--global-batch-size", str(args.rollout_sequences), "--seq-length", str(args.seq_length),
            "--rollout-sequences", str(args.rollout_sequences), "--rollout-max-tokens", str(args.seq_length),
            "--rollout-engine-weights", "shared", *recompute]


def plan(args, preset: str, recompute: tuple, gpu_memory_gib: float, *extra: str) -> dict:
    command = [sys.executable, str(REPO / "tools" / "plan_memory.py"),
               *plan_flags(args, preset, recompute, gpu_memory_gib), *extra, "--json"]
    return run_json_child(command, f"planner for {preset}", timeout=120)["plans"]


def choose(args, gpu_memory_gib: float):
    """``(preset, recompute flags, plans)``: the largest preset whose LoGRA plan fits."""
    presets = LARGEST_FIRST if args.preset == AUTO else (args.preset,)
    for preset in presets:
        recompute, plans = recompute_for(args, preset, gpu_memory_gib)
        if plans["logra"]["fits"] or args.preset != AUTO:
            return preset, recompute, plans
    raise UserError(f"no preset fits LoGRA on a GPU of {gpu_memory_gib} GiB")


def recompute_for(args, preset: str, gpu_memory_gib: float):
    """``(recompute flags, plans)``: no recomputation when LoGRA's plan leaves
    :data:`SPARE_FRACTION` of the GPU spare, else full recomputation of every layer."""
    plans = plan(args, preset, (), gpu_memory_gib)
    if plans["logra"]["total_per_gpu_bytes"] <= (1 - SPARE_FRACTION) * gpu_memory_gib * GIB:
        return (), plans
    return RECOMPUTE_CHOICES[1], plan(args, preset, RECOMPUTE_CHOICES[1], gpu_memory_gib)


def run_steps(args, preset: str, recompute: tuple) -> dict:
    """Build on this process's device and take ``--steps`` RL-shaped steps; measured figures."""
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.models import get_preset
    from logra_megatron.platform import cuda_available
    from logra_megatron.platform.memory import AllocationTracker
    from logra_megatron.rl.advantages import AdvantageConfig, group_advantages
    from logra_megatron.rl.grpo import policy_loss_backward, probe_and_held_out, sequence_logprobs
    from logra_megatron.rl.losses import PolicyLossConfig
    from logra_megatron.rollout.megatron_engine import MegatronEngine
    from logra_megatron.rollout.types import SamplingConfig
    from logra_megatron.training.config import KLControlConfig, OptimizerSettings, RecomputeConfig
    from logra_megatron.training.kl_control import PredictedKLController
    from logra_megatron.training.measure import measure_components
    from logra_megatron.training.setup import build_trainable

    model_config = get_preset(preset)
    parallel.initialize(1, 1, seed=args.seed)
    on_cuda = cuda_available()
    recompute_config = RecomputeConfig("full", "uniform", 1) if recompute else RecomputeConfig()
    start = time.perf_counter()
    model, ddp, optimizer = build_trainable(
        model_config, OptimizerSettings(kind="logra", lr=1e-6, clip_grad=1.0),
        LogRAConfig(master="bf16-sr", embeddings=True), dtype=torch.bfloat16, seed=args.seed,
        recompute=recompute_config)
    if on_cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    device = next(model.parameters()).device
    state_bytes = sum(measure_components(model, ddp, optimizer).values())  # LoGRA's state exists from the build
    controller = PredictedKLController(KLControlConfig(mode="probe", realized_interval=0,
                                                       probe_sequences=args.kl_probe_sequences))
    engine = MegatronEngine(ddp)
    prompt_length = args.seq_length - args.rollout_max_tokens
    # Synthetic prompts and rewards, drawn on the CPU on purpose: host token lists, as a tokenizer gives them.
    generator = torch.Generator().manual_seed(args.seed)
    group = 2
    advantage_config = AdvantageConfig(group_size=group)
    step_seconds, controls = [], []

    def rl_step(step):
        prompts = torch.randint(0, model_config.vocab, (args.rollout_sequences // group, prompt_length),
                                generator=generator).tolist()
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.rollout_max_tokens,
                                  samples_per_prompt=group, seed=step, vocab_size=model_config.vocab)
        rollouts = engine.generate(prompts, sampling)
        rewards = torch.randint(0, 2, (rollouts.tokens.shape[0],), generator=generator).float().to(device)
        advantages = group_advantages(rewards, advantage_config)
        old_logprobs, _ = sequence_logprobs(ddp, rollouts, 1, 1.0, model_config.vocab)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        policy_loss_backward(ddp, rollouts, advantages, old_logprobs, 1, PolicyLossConfig(),
                             vocab_size=model_config.vocab)
        probe, held_out = probe_and_held_out(rollouts, args.kl_probe_sequences, 1, model_config.vocab)
        return controller.step(ddp, optimizer, probe, held_out)

    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    tracker = None if on_cuda or args.steps == 0 else AllocationTracker()
    for step in range(args.steps):
        start = time.perf_counter()
        if tracker is not None and step == args.steps - 1:
            with tracker:  # the profiler's allocation events (CPU): only the last step, it is slow
                controls.append(rl_step(step))
        else:
            controls.append(rl_step(step))
        if on_cuda:
            torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - start)
    if on_cuda:
        peak = torch.cuda.max_memory_allocated()
        peak_source = "torch.cuda.max_memory_allocated"
    elif tracker is None or args.steps == 0:
        peak, peak_source = state_bytes, "live state after the build (CPU, no step taken)"
    else:
        peak = state_bytes + tracker.peak_bytes
        peak_source = "live state + peak of tracked allocations (CPU)"
    return {"device": str(device), "build_s": build_s, "step_s": step_seconds, "measured_peak_bytes": int(peak),
            "peak_source": peak_source, "state_bytes_after_build": int(state_bytes),
            "kl_pred": [c["kl_pred"] for c in controls], "step_scale": [c["step_scale"] for c in controls],
            "success": all(c["success"] for c in controls)}


BASELINES = ("adam", "adam-precision-aware", "adam-cpu-offload", "adam-cpu-offload-bf16-grads", "adam-8bit", "adam-kl")
"""The planner's dense rows (logra_megatron/planning/settings.py ``ROWS``), and CPU offload with
Megatron's bf16 main grads (``--main-grads-dtype bf16``)."""


def plan_table(args) -> list:
    """Per preset and GPU size: LoGRA (bf16-sr, sketched embeddings; full recomputation where
    :func:`recompute_for` asks for it) and every dense baseline of the planner for the same job,
    at full recomputation (their least GPU memory), with the host memory of CPU offload."""
    rows = []
    for preset in LARGEST_FIRST[:-1]:
        for gib in (80, 141):
            recompute, plans = recompute_for(args, preset, gib)
            dense = plan(args, preset, RECOMPUTE_CHOICES[1], gib, "--optimizer", "all")
            offload_bf16 = plan(args, preset, RECOMPUTE_CHOICES[1], gib, "--optimizer", "adam-cpu-offload",
                                "--main-grads-dtype", "bf16")
            dense["adam-cpu-offload-bf16-grads"] = offload_bf16["adam-cpu-offload"]
            row = {"preset": preset, "gpu_memory_gib": gib, "recompute": "full" if recompute else "none",
                   "logra_bytes": plans["logra"]["total_per_gpu_bytes"], "logra_fits": plans["logra"]["fits"],
                   "dense_adam_bytes": dense["adam"]["total_per_gpu_bytes"], "dense_adam_fits": dense["adam"]["fits"],
                   "host_offload_bytes": dense["adam-cpu-offload"]["host_bytes"]}
            for name in BASELINES:
                row[f"{name}_bytes"], row[f"{name}_fits"] = dense[name]["gpu_bytes"], dense[name]["fits"]
            rows.append(row)
    return rows


def print_plan_table(rows: list) -> None:
    print("| preset | GPU | recompute (LoGRA) | LoGRA bf16-sr | `adam` | `adam-precision-aware` | "
          "`adam-cpu-offload` (fp32 / bf16 grads) | `adam-8bit` | `adam-kl` | host, offload | measured on a GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | ---: | --- |")

    def verdict(total, fits):
        return f"{total / GIB:.1f} ({'fits' if fits else '**no**'})"

    for row in rows:
        cells = [verdict(row[f"{name}_bytes"], row[f"{name}_fits"]) for name in BASELINES]
        cells[2:4] = [f"{cells[2]} / {cells[3]}"]
        print(f"| {row['preset']} | {row['gpu_memory_gib']} GiB | {row['recompute']} | "
              f"{verdict(row['logra_bytes'], row['logra_fits'])} | {' | '.join(cells)} | "
              f"{row['host_offload_bytes'] / GIB:.0f} GiB | not measured on a GPU yet |")


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plan_table:
        rows = plan_table(args)
        print(json.dumps(rows)) if args.json else print_plan_table(rows)
        return
    import torch

    from logra_megatron.platform import cuda_available

    gpu_memory_gib = args.gpu_memory_gib
    if gpu_memory_gib is None:
        gpu_memory_gib = (torch.cuda.get_device_properties(0).total_memory / GIB) if cuda_available() else 141.0
    preset, recompute, plans = choose(args, gpu_memory_gib)
    measured = run_steps(args, preset, recompute)
    planned = plans["logra"]["total_per_gpu_bytes"]
    report = {
        "preset": preset, "gpu_memory_gib": round(gpu_memory_gib, 1), "recompute": " ".join(recompute) or "none",
        "seq_length": args.seq_length, "rollout_sequences": args.rollout_sequences,
        "rollout_max_tokens": args.rollout_max_tokens, "planned_logra_bytes": planned,
        "planned_logra_fits": plans["logra"]["fits"], "planned_dense_adam_bytes": plans["adam"]["total_per_gpu_bytes"],
        "planned_dense_adam_fits": plans["adam"]["fits"], **measured,
        "measured_over_planned": measured["measured_peak_bytes"] / planned,
    }
    report["within_5_percent"] = abs(report["measured_over_planned"] - 1.0) <= 0.05
    if args.json:
        print(json.dumps(report))
        return
    print(f"{preset} on {report['device']} (recompute: {report['recompute']}), built in {report['build_s']:.1f} s")
    print(f"  LoGRA bf16-sr planned {planned / GIB:.2f} GiB, measured peak {report['measured_peak_bytes'] / GIB:.2f} GiB "
          f"({report['peak_source']}): x{report['measured_over_planned']:.3f}")
    print(f"  dense Adam planned {report['planned_dense_adam_bytes'] / GIB:.2f} GiB: "
          f"{'fits' if report['planned_dense_adam_fits'] else 'does NOT fit'} in {gpu_memory_gib:.0f} GiB")
    print("  step times: " + ", ".join(f"{s:.2f} s" for s in report["step_s"]))


if __name__ == "__main__":
    main()
