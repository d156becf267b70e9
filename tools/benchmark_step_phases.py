"""Where the time of one training step goes: dense Adam beside LoGRA, phase by phase.

    python tools/benchmark_step_phases.py --preset tiny --steps 2 --json
    python tools/benchmark_step_phases.py --preset smollm2-135m --bf16 --logra-master bf16-sr \\
        --logra-rank 64 --logra-embeddings --kl-control probe --steps 3

Each optimizer runs in its own child process (as tools/benchmark_optimizer.py does), on the same
model from the same seed and the same batch (``--global-batch-size`` x ``--seq-length`` tokens),
on the device the package computes on (``logra_megatron.platform.default_device()``: CUDA when
present). One warm-up step (it allocates the optimizer's state), then ``--steps`` timed steps.
The phases are the ones the code marks (``logra_megatron/platform/phases.py``: a
``torch.profiler`` range each, timed with a device synchronization before and after on CUDA):

- ``zero_grad``: clearing grads and sketches; LoGRA draws its norm probes (``norm_probe_draw``)
  and arms the range finder on a refresh step (``range_finder_arm``);
- ``forward_backward``: Megatron's schedule; LoGRA's backward writes the sketches (and the
  range finder's samples on a refresh step) instead of the weight gradients;
- ``optimizer_step``: the KL controller's step around the optimizer, made of ``sketch_reduce``
  (LoGRA's sketches reduced over DP), ``grad_norm`` (finiteness checks, dense norm, LoGRA's
  sketch norm and norm-probe residual, clipping), ``dense_step`` (Megatron's Adam: all of dense
  Adam's parameters, or LoGRA's dense remainder), ``update_rule`` (LoGRA's sketch-space ``U``),
  ``kl_forecast`` (LoGRA side, ``--kl-control probe|linear``: the forecast's forward passes and
  reductions: the probe's ``s = 0`` logits once, the forecast at the full step and the scale
  search's refinements), ``kl_realized`` (the realized KL of the committed step, on the steps
  ``--kl-realized-interval`` picks; 0, the default, measures none), ``commit`` (LoGRA's row-block
  update through the master mode) and
  ``range_finder`` (LoGRA, refresh steps only: the new projections, the state rotated).

The refresh interval is ``--logra-refresh-interval`` (default: ``--steps``, so the last timed step
refreshes and the range finder is timed). Per side: each phase's median over the timed steps it
ran in, ``step_time_s`` (median over the timed steps that did not refresh), ``refresh_step_time_s``
(a refresh step), ``amortized_step_time_s`` (a step with a refresh every 10 steps, the trainer's
default), ``step_time_without_kl_s`` (the step less its KL forecast and realized KL) and
``controller_share`` (the controller's phases, ``kl_forecast`` + ``kl_realized``, over the whole
step, median over the same steps as ``step_time_s``), in wall time and, under
``cpu``, in the process's CPU time (all threads; less disturbed by other jobs on a shared
machine); the dense side runs as users run Megatron's Adam (``--kl-control off``). The parent
prints a table, or with ``--json`` one object ``{"settings", "dense", "logra", "ratio",
"controller_share"}`` (the last: LoGRA's, in wall time).
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.logra.config import LogRAConfig, add_rank_arguments  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig  # noqa: E402
from logra_megatron.schema import add_flags  # noqa: E402
from logra_megatron.training.config import KLControlConfig  # noqa: E402
from _bench_common import run_json_child, validate_benchmark_args  # noqa: E402

TOP_PHASES = ("zero_grad", "forward_backward", "optimizer_step")
OPTIMIZER_PHASES = ("sketch_reduce", "grad_norm", "dense_step", "update_rule", "kl_forecast", "kl_realized",
                    "commit", "range_finder")
CONTROLLER_PHASES = ("kl_forecast", "kl_realized")
ZERO_GRAD_PHASES = ("norm_probe_draw", "range_finder_arm")
PHASES = TOP_PHASES + OPTIMIZER_PHASES + ZERO_GRAD_PHASES
TIMES = ("step_time_s", "step_time_without_kl_s", "refresh_step_time_s", "amortized_step_time_s")
TRAINER_REFRESH_INTERVAL = LogRAConfig().refresh_interval


def parse_args(argv):
    parser = ArgumentParser(prog="benchmark_step_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    add_rank_arguments(parser)
    add_flags(parser, LogRAConfig, "refresh_interval", "master", "embeddings", defaults={"refresh_interval": None},
              notes={"refresh_interval": "--steps, so one timed step refreshes"})
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (both sides)")
    add_flags(parser, ModelSourceConfig, "attention_backend")
    # KL control runs on the LoGRA side only (dense Adam runs as users run it: without); the
    # realized KL is off so every timed step costs the same.
    add_flags(parser, KLControlConfig, "mode", "probe_sequences", "realized_interval",
              defaults={"realized_interval": 0})
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=("adam", "logra"), help=_hidden())
    args = parser.parse_args(argv)
    for name in ("steps", "micro_batch_size", "global_batch_size", "seq_length", "kl_probe_sequences"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kl_realized_interval < 0:
        parser.error("--kl-realized-interval must be >= 0")
    if args.logra_refresh_interval is None:
        args.logra_refresh_interval = args.steps
    return args


def _hidden():
    import argparse

    return argparse.SUPPRESS


def validate(args):
    """Fail fast, in the parent, on bad input."""
    return validate_benchmark_args(args)


def run_child(args) -> dict:
    import torch

    from logra_megatron import parallel
    from logra_megatron.models.build import model_device
    from logra_megatron.platform.phases import PhaseTimer, phase
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable

    model_config, logra_config = validate(args)
    parallel.initialize(1, 1, seed=args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model, ddp, optimizer = build_trainable(
        model_config, OptimizerSettings(kind=args.child, lr=args.lr, clip_grad=1.0), logra_config, dtype=dtype,
        seed=args.seed, attention_backend=args.attention_backend)
    device = model_device(model)
    # Token ids drawn on the CPU on purpose (the same batch on every device kind), moved once.
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator).to(device)
    mode = args.kl_control if args.child == "logra" else "off"
    controller = PredictedKLController(KLControlConfig(
        mode=mode, realized_interval=args.kl_realized_interval if args.child == "logra" else 0))
    # The probe: the first rows of the batch as the step's forward sees them (its inputs,
    # tokens[:, :-1]), every position counted; as in the trainer, that forward keeps their s = 0
    # logits for the controller.
    count = min(args.kl_probe_sequences, len(tokens))
    rows = tokens[:count, :-1]
    probe = ProbeSet(rows, torch.ones_like(rows, dtype=torch.float), micro_batch_size=args.micro_batch_size,
                     rows=torch.arange(count, device=device))

    def step():
        with phase("zero_grad"):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
        keep = controller.step_logits(probe)
        with phase("forward_backward"):
            loss = lm_forward_backward(ddp, tokens, args.micro_batch_size, keep_logits=keep)
        with phase("optimizer_step"):
            control = controller.step(ddp, optimizer, probe, step_logits=keep)
        return loss, control

    refresh = getattr(optimizer, "is_refresh_step", lambda: False)
    step()  # warm-up: the optimizer's state is allocated here
    per_step, loss = [], None
    for _ in range(args.steps):
        refreshing = bool(refresh())
        with PhaseTimer(device) as timer, phase("step"):
            loss, control = step()
        if not control["success"]:
            raise UserError(f"the {args.child} step was skipped (a non-finite gradient or forecast)")
        per_step.append({"refresh": refreshing, "seconds": dict(timer.seconds),
                         "cpu_seconds": dict(timer.cpu_seconds), "step_scale": control["step_scale"],
                         "kl_pred": control["kl_pred"], "kl_forecasts": controller.forecasts})
    wall, cpu = summarize(per_step, "seconds"), summarize(per_step, "cpu_seconds")
    return {**wall, "cpu": cpu, "timed_steps": len(per_step),
            "refresh_steps": sum(entry["refresh"] for entry in per_step), "final_loss": loss, "steps": per_step}


def summarize(per_step: list, key: str) -> dict:
    """The medians of the timed steps' ``key`` figures (wall ``seconds`` or ``cpu_seconds``;
    module docstring)."""
    def median(values):
        return statistics.median(values) if values else None

    phases = {}
    for name in PHASES:
        values = [entry[key][name] for entry in per_step if name in entry[key]]
        if values:
            phases[name] = median(values)
    for entry in per_step:
        seconds = entry[key]
        seconds["other"] = seconds["step"] - sum(seconds.get(name, 0.0) for name in TOP_PHASES)
        seconds["optimizer_other"] = seconds["optimizer_step"] - sum(seconds.get(name, 0.0)
                                                                     for name in OPTIMIZER_PHASES)
    phases["optimizer_other"] = median([entry[key]["optimizer_other"] for entry in per_step])
    phases["other"] = median([entry[key]["other"] for entry in per_step])
    plain = [entry[key]["step"] for entry in per_step if not entry["refresh"]]
    refreshing = [entry[key]["step"] for entry in per_step if entry["refresh"]]
    counted = [entry for entry in per_step if not entry["refresh"]] or per_step
    controller = [sum(entry[key].get(name, 0.0) for name in CONTROLLER_PHASES) for entry in counted]
    without_kl = [entry[key]["step"] - seconds for entry, seconds in zip(counted, controller)]
    shares = [seconds / entry[key]["step"] for entry, seconds in zip(counted, controller)]
    step_time = median(plain) if plain else median(refreshing)
    refresh_time = median(refreshing)
    amortized = step_time if refresh_time is None else \
        step_time + (refresh_time - step_time) / TRAINER_REFRESH_INTERVAL
    return {"phases_s": phases, "step_time_s": step_time, "step_time_without_kl_s": median(without_kl),
            "refresh_step_time_s": refresh_time, "amortized_step_time_s": amortized,
            "controller_s": median(controller), "controller_share": median(shares)}


def run_parent(args) -> dict:
    validate(args)
    results = {}
    for kind in ("adam", "logra"):
        if not args.json:
            print(f"[benchmark] {kind}: 1 warm-up + {args.steps} timed steps ...", file=sys.stderr, flush=True)
        results["dense" if kind == "adam" else "logra"] = run_json_child(
            [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", kind], kind)
    dense, logra = results["dense"], results["logra"]
    ratio = {key: logra[key] / dense[key] for key in TIMES if logra.get(key) and dense.get(key)}
    ratio["cpu"] = {key: logra["cpu"][key] / dense["cpu"][key] for key in TIMES
                    if logra["cpu"].get(key) and dense["cpu"].get(key)}
    settings = {"preset": args.preset, "rank": args.logra_rank, "max_rank": args.logra_max_rank,
                "bf16": args.bf16, "logra_master": args.logra_master, "logra_embeddings": args.logra_embeddings,
                "kl_control": args.kl_control, "kl_probe_sequences": args.kl_probe_sequences,
                "kl_realized_interval": args.kl_realized_interval,
                "refresh_interval": args.logra_refresh_interval, "steps": args.steps,
                "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
                "seq_length": args.seq_length, "attention_backend": args.attention_backend,
                "device": _device_name()}
    return {"settings": settings, "dense": dense, "logra": logra, "ratio": ratio,
            "controller_share": logra["controller_share"]}


def _device_name() -> str:
    from logra_megatron.platform import default_device

    return str(default_device())


def print_table(report) -> None:
    s = report["settings"]
    print(f"preset {s['preset']} on {s['device']}  {'bf16' if s['bf16'] else 'fp32'}  LoGRA rank {s['rank']} "
          f"(at most {s['max_rank']}), master {s['logra_master']}, embeddings "
          f"{'sketched' if s['logra_embeddings'] else 'dense'}, kl-control {s['kl_control']}  "
          f"{s['global_batch_size']} x {s['seq_length']} tokens, {s['steps']} timed steps "
          f"(refresh every {s['refresh_interval']})")
    dense, logra = report["dense"], report["logra"]
    print(f"{'median s (wall | CPU)':<26}{'dense Adam':>11}{'LoGRA':>11}  |{'dense Adam':>11}{'LoGRA':>11}")
    shown = (("zero_grad", 0),) + tuple((name, 1) for name in ZERO_GRAD_PHASES) + \
        (("forward_backward", 0), ("optimizer_step", 0)) + \
        tuple((name, 1) for name in OPTIMIZER_PHASES + ("optimizer_other",)) + (("other", 0),)
    for name, depth in shown:
        figures = [side["phases_s"].get(name) for side in (dense, logra, dense["cpu"], logra["cpu"])]
        if figures[0] is None and figures[1] is None:
            continue
        print(f"{'  ' * depth + name:<26}{_seconds(figures[0]):>11}{_seconds(figures[1]):>11}  |"
              f"{_seconds(figures[2]):>11}{_seconds(figures[3]):>11}")
    print(f"{'':<26}{'dense Adam':>11}{'LoGRA':>11}{'ratio':>7}  |{'dense Adam':>11}{'LoGRA':>11}{'ratio':>7}")
    for key in TIMES:
        wall, cpu = report["ratio"].get(key), report["ratio"]["cpu"].get(key)
        print(f"{key:<26}{_seconds(dense.get(key)):>11}{_seconds(logra.get(key)):>11}{_ratio(wall):>7}  |"
              f"{_seconds(dense['cpu'].get(key)):>11}{_seconds(logra['cpu'].get(key)):>11}{_ratio(cpu):>7}")
    print(f"controller_share (LoGRA: kl_forecast + kl_realized over the step)  wall {_ratio(logra['controller_share'])}"
          f"  |  CPU {_ratio(logra['cpu']['controller_share'])}")


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.4f}"


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    report = run_parent(args)
    if args.json:
        print(json.dumps(report))
        print(f"controller_share {report['controller_share']:.3f}", file=sys.stderr)
    else:
        print_table(report)


if __name__ == "__main__":
    main()
