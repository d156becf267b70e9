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
  ``--kl-realized-interval`` picks; 0, the default, measures none; both made of ``kl_preview``:
  the weights moved to ``W + s D`` and back, ``kl_probe_forward``: the probe's forward passes,
  ``kl_divergence``: the KL of their logits), ``commit`` (LoGRA's row-block
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

``--data-parallel N`` (N > 1) runs every side on N ranks (``torch.distributed.run``; gloo on the
CPU), each rank on its ``1 / N`` of the batch (its probe: the first ``--kl-probe-sequences`` of
its own rows, as the trainer's is of its own rollouts), and LoGRA twice, one after the other in
the same ranks (a fresh model, optimizer and warm-up step each): with the sketch reduction
blocking (one all-reduce after the whole backward: the ``logra`` side), then overlapped with the
backward (Megatron's ``--overlap-grad-reduce``: per-bucket all-reduces started as the
backward completes each bucket, ``logra/sketch_overlap.py``; buckets of ``--ddp-bucket-size``
elements). The JSON then also holds ``logra_overlapped`` (that run's figures, as ``logra``'s) and
``sketch_reduction``: per mode (``blocking``, ``overlapped``) the step time, the exposed
reduction (``exposed_reduce_s``: the ``sketch_reduce`` phase, which is what the step waits on the
sketch reduction after the backward, median over the steps ``step_time_s`` counts, and per rank),
the sketch buffer's bytes at the collectives per step (``sketch_collective_bytes``, each
collective's input, summed; ``sketch_collectives``: how many calls) and the buckets, and how many
of them started during the backward; ``collective_bytes_equal`` says the two modes' bytes agree.
Rank 0's figures unless said.
"""

import contextlib
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
from _bench_common import run_json_child, torchrun_command, validate_benchmark_args  # noqa: E402

TOP_PHASES = ("zero_grad", "forward_backward", "optimizer_step")
OPTIMIZER_PHASES = ("sketch_reduce", "grad_norm", "dense_step", "update_rule", "kl_forecast", "kl_realized",
                    "commit", "range_finder")
CONTROLLER_PHASES = ("kl_forecast", "kl_realized")
ZERO_GRAD_PHASES = ("norm_probe_draw", "range_finder_arm")
KL_PHASES = ("kl_preview", "kl_probe_forward", "kl_divergence")
"""Inside kl_forecast and kl_realized (training/kl_control.py: kl)."""
PHASES = TOP_PHASES + OPTIMIZER_PHASES + ZERO_GRAD_PHASES + KL_PHASES
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
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="data-parallel ranks (torch.distributed, gloo on the CPU); above 1 LoGRA also runs "
                             "with its sketch reduction overlapped with the backward (--overlap-grad-reduce) beside "
                             "the blocking one (default 1: one process per side)")
    parser.add_argument("--ddp-bucket-size", type=int, default=None,
                        help="elements per gradient bucket of the overlapped run (Megatron's; LoGRA's sketch "
                             "buckets too) (default: Megatron's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=("adam", "logra"), help=_hidden())
    args = parser.parse_args(argv)
    for name in ("steps", "micro_batch_size", "global_batch_size", "seq_length", "kl_probe_sequences",
                 "data_parallel"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kl_realized_interval < 0:
        parser.error("--kl-realized-interval must be >= 0")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        parser.error("--ddp-bucket-size must be >= 1")
    if args.logra_refresh_interval is None:
        args.logra_refresh_interval = args.steps
    return args


def _hidden():
    import argparse

    return argparse.SUPPRESS


def validate(args):
    """Fail fast, in the parent, on bad input."""
    configs = validate_benchmark_args(args)
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel):
        raise UserError("--global-batch-size must be a multiple of --micro-batch-size x --data-parallel")
    return configs


def run_child(args, overlap: bool = False) -> dict:
    """One side's timed steps; ``overlap``: the sketch reduction overlapped with the backward."""
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
        seed=args.seed, attention_backend=args.attention_backend, overlap_grad_reduce=overlap,
        ddp_bucket_size=args.ddp_bucket_size if overlap else None)
    device = model_device(model)
    # Token ids drawn on the CPU on purpose (the same batch on every device kind), moved once;
    # each data-parallel rank takes its share of the rows.
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator)
    local = args.global_batch_size // parallel.dp_size()
    tokens = tokens[parallel.dp_rank() * local:(parallel.dp_rank() + 1) * local].to(device)
    sketches = getattr(getattr(optimizer, "low_rank", None), "sketch_buffer", None)
    counter = SketchCollectives(sketches) if parallel.dp_size() > 1 and sketches is not None else None
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
        # Buckets whose reduction the backward started (overlapped only): the overlap's evidence.
        started = sketches.overlap.started if sketches is not None and sketches.overlap is not None else 0
        with phase("optimizer_step"):
            control = controller.step(ddp, optimizer, probe, step_logits=keep)
        return loss, control, started

    refresh = getattr(optimizer, "is_refresh_step", lambda: False)
    step()  # warm-up: the optimizer's state is allocated here
    per_step, loss = [], None
    for _ in range(args.steps):
        refreshing = bool(refresh())
        if counter is not None:
            counter.reset()
        with PhaseTimer(device) as timer, phase("step"), counter or contextlib.nullcontext():
            loss, control, started = step()
        if not control["success"]:
            raise UserError(f"the {args.child} step was skipped (a non-finite gradient or forecast)")
        entry = {"refresh": refreshing, "seconds": dict(timer.seconds),
                 "cpu_seconds": dict(timer.cpu_seconds), "step_scale": control["step_scale"],
                 "kl_pred": control["kl_pred"], "kl_pred_forecast_scale": control.get("kl_pred_forecast_scale"),
                 "kl_forecasts": controller.forecasts}
        if counter is not None:
            entry.update(sketch_collective_bytes=counter.bytes, sketch_collectives=counter.calls,
                         sketch_buckets_started_in_backward=started)
        per_step.append(entry)
    wall, cpu = summarize(per_step, "seconds"), summarize(per_step, "cpu_seconds")
    result = {**wall, "cpu": cpu, "timed_steps": len(per_step),
              "refresh_steps": sum(entry["refresh"] for entry in per_step), "final_loss": loss, "steps": per_step}
    if parallel.dp_size() > 1:
        result["data_parallel"] = parallel.dp_size()
        result["overlap_grad_reduce"] = overlap
        if counter is not None:
            result["sketch_buckets"] = len(sketches.buckets)
        # Each rank's exposed reduction (the sketch_reduce phase, as step_time_s counts steps).
        mine = exposed_reduce(per_step, "seconds")
        ranks = [None] * parallel.dp_size()
        torch.distributed.all_gather_object(ranks, mine)
        result["exposed_reduce_per_rank_s"] = ranks
    return result


def exposed_reduce(per_step: list, key: str):
    """The median ``sketch_reduce`` phase (what the step waits on the sketch reduction after the
    backward) over the steps ``step_time_s`` counts (those that did not refresh, else all)."""
    counted = [entry for entry in per_step if not entry["refresh"]] or per_step
    values = [entry[key]["sketch_reduce"] for entry in counted if "sketch_reduce" in entry[key]]
    return statistics.median(values) if values else None


class SketchCollectives:
    """While entered, counts the collectives (``torch.distributed.all_reduce`` and
    ``reduce_scatter_tensor``) whose input is a part of LoGRA's flat sketch buffer ``sketches``
    (the sketch reduction's, blocking or overlapped): ``calls`` and ``bytes`` (the inputs' bytes,
    what each rank puts into them). Both functions are looked up on the module at each call by
    the sketch reduction (``logra/sketch_buffer.py``, ``logra/sketch_overlap.py``)."""

    NAMES = {"all_reduce": 0, "reduce_scatter_tensor": 1}
    """Function name: the position of the input tensor among its arguments."""

    def __init__(self, sketches):
        self.storage = sketches.flat.untyped_storage().data_ptr()
        self._saved = {}
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0

    def __enter__(self):
        import torch.distributed as dist

        for name, position in self.NAMES.items():
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args, _original=original, _position=position, **kwargs):
                tensor = args[_position] if len(args) > _position else None
                if tensor is not None and tensor.untyped_storage().data_ptr() == self.storage:
                    self.calls += 1
                    self.bytes += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}
        return False


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
    script = os.path.abspath(__file__)
    for key, kind in (("dense", "adam"), ("logra", "logra")):
        if not args.json:
            more = " (blocking, then overlapped)" if kind == "logra" and args.data_parallel > 1 else ""
            print(f"[benchmark] {key}{more}: 1 warm-up + {args.steps} timed steps ...", file=sys.stderr, flush=True)
        child = [*sys.argv[1:], "--child", kind]
        command = torchrun_command(args.data_parallel, script, *child) if args.data_parallel > 1 else \
            [sys.executable, script, *child]
        results[key] = run_json_child(command, key)
    if args.data_parallel > 1:
        results["logra_overlapped"] = results["logra"].pop("overlapped")
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
                "device": _device_name(), "data_parallel": args.data_parallel}
    report = {"settings": settings, "dense": dense, "logra": logra, "ratio": ratio,
              "controller_share": logra["controller_share"]}
    if args.data_parallel > 1:
        settings["ddp_bucket_size"] = args.ddp_bucket_size
        report["logra_overlapped"] = results["logra_overlapped"]
        report["sketch_reduction"] = sketch_reduction(logra, results["logra_overlapped"])
    return report


def sketch_reduction(blocking: dict, overlapped: dict) -> dict:
    """LoGRA's sketch reduction at DP > 1, blocking beside overlapped (module docstring)."""
    def mode(result):
        steps = result["steps"]
        return {"step_time_s": result["step_time_s"], "exposed_reduce_s": exposed_reduce(steps, "seconds"),
                "exposed_reduce_per_rank_s": result["exposed_reduce_per_rank_s"],
                "cpu": {"step_time_s": result["cpu"]["step_time_s"],
                        "exposed_reduce_s": exposed_reduce(steps, "cpu_seconds")},
                "sketch_collective_bytes": steps[-1]["sketch_collective_bytes"],
                "sketch_collectives": steps[-1]["sketch_collectives"],
                "sketch_buckets": result["sketch_buckets"],
                "sketch_buckets_started_in_backward": steps[-1]["sketch_buckets_started_in_backward"]}

    out = {"blocking": mode(blocking), "overlapped": mode(overlapped)}
    out["collective_bytes_equal"] = all(
        a["sketch_collective_bytes"] == b["sketch_collective_bytes"]
        for a, b in zip(blocking["steps"], overlapped["steps"]))
    return out


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
        tuple(entry for name in OPTIMIZER_PHASES + ("optimizer_other",)
              for entry in [(name, 1)] + ([(kl, 2) for kl in KL_PHASES] if name == "kl_realized" else [])) + \
        (("other", 0),)
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
    reduction = report.get("sketch_reduction")
    if reduction:
        print(f"LoGRA's sketch reduction at DP {s['data_parallel']}  (wall | CPU, rank 0)")
        print(f"{'':<14}{'step s':>9}{'exposed s':>11}  |{'step s':>9}{'exposed s':>11}{'bytes':>12}{'calls':>7}"
              f"{'buckets (in bwd)':>18}")
        for name in ("blocking", "overlapped"):
            m = reduction[name]
            print(f"{name:<14}{_seconds(m['step_time_s']):>9}{_seconds(m['exposed_reduce_s']):>11}  |"
                  f"{_seconds(m['cpu']['step_time_s']):>9}{_seconds(m['cpu']['exposed_reduce_s']):>11}"
                  f"{m['sketch_collective_bytes']:>12}{m['sketch_collectives']:>7}"
                  f"{m['sketch_buckets']:>10} ({m['sketch_buckets_started_in_backward']})")
        print(f"same bytes at the collectives: {reduction['collective_bytes_equal']}")


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.4f}"


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        result = run_child(args)
        if args.child == "logra" and args.data_parallel > 1:
            # The same ranks again, the reduction overlapped (one launch for both: the start-up
            # of torch.distributed.run and the imports cost more than a step on tiny).
            result["overlapped"] = run_child(args, overlap=True)
        import torch.distributed as dist

        if dist.get_rank() == 0:  # one answer from a multi-rank child (rank 0's figures)
            print(json.dumps(result))
        return
    report = run_parent(args)
    if args.json:
        print(json.dumps(report))
        print(f"controller_share {report['controller_share']:.3f}", file=sys.stderr)
    else:
        print_table(report)


if __name__ == "__main__":
    main()
