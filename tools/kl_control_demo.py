"""Predicted-KL control on the `tiny` preset with a deliberately large learning rate.

    python tools/kl_control_demo.py [--json]

A fixed batch of sequences, a few LoGRA steps with control off, with ``probe`` and with
``linear``, from the same initial weights. Off shows the realized KL of each uncontrolled step;
the controlled runs show the forecast, the step scale and the realized KL, which should stay
near ``--kl-target``. ``overhead_fraction`` is the probe controller's time over its steps' time.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import exit_on_user_error  # noqa: E402
from logra_megatron.rl.config import RunConfig  # noqa: E402
from logra_megatron.schema import add_flags, validate_flags  # noqa: E402
from logra_megatron.training.config import KLControlConfig, OptimizerSettings  # noqa: E402


def build_parser():
    parser = ArgumentParser(prog="kl_control_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    # The demo's point is a step that overshoots: an lr ~170x the trainer's, so that uncontrolled
    # steps exceed the KL budget and the controller has to scale them down.
    add_flags(parser, OptimizerSettings, "lr", defaults={"lr": 5e-2}, notes={"lr": "5e-2, deliberately large"})
    # A budget the tiny model's steps at that lr exceed by a visible margin, forecast from 2 of the
    # 8 fixed sequences (the trainer's 8 probe sequences would be the whole batch).
    add_flags(parser, KLControlConfig, "target", "probe_sequences",
              defaults={"target": 0.02, "probe_sequences": 2})
    add_flags(parser, RunConfig, "seed")
    parser.add_argument("--json", action="store_true")
    return parser


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_flags(parser, args)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def run_mode(mode, args, tokens):
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.models import get_preset
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable

    parallel.initialize(1, 1, seed=args.seed)
    _, ddp, optimizer = build_trainable(get_preset("tiny"), OptimizerSettings(kind="logra", lr=args.lr),
                                        LogRAConfig(rank=16, refresh_interval=5))
    controller = PredictedKLController(
        KLControlConfig(mode=mode, target=args.kl_target, probe_sequences=args.kl_probe_sequences,
                        realized_interval=1))  # the realized KL of every step
    rows = tokens[: args.kl_probe_sequences]
    probe = ProbeSet(rows, torch.ones_like(rows, dtype=torch.float), micro_batch_size=len(rows))
    history = {"kl_pred": [], "kl_realized": [], "step_scale": [], "loss": []}
    controller_time = step_time = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = lm_forward_backward(ddp, tokens, 4)
        metrics = controller.step(ddp, optimizer, probe)
        step_time += time.perf_counter() - start
        controller_time += metrics["controller_time_s"]
        for key in ("kl_pred", "kl_realized", "step_scale"):
            history[key].append(metrics[key])
        history["loss"].append(loss)
    return history, controller_time, step_time


@exit_on_user_error
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(args.seed))
    report = {"kl_target": args.kl_target, "lr": args.lr, "steps": args.steps}
    for mode in ("off", "probe", "linear"):
        history, controller_time, step_time = run_mode(mode, args, tokens)
        if mode == "off":
            history = {"kl_realized": history["kl_realized"], "loss": history["loss"]}
        report[mode] = history
        if mode == "probe":
            report["overhead_fraction"] = controller_time / step_time
    if args.json:
        print(json.dumps(report))
        return
    print(f"kl_target {args.kl_target}  lr {args.lr}  (overhead of probe control: "
          f"{100 * report['overhead_fraction']:.0f}% of step time)")
    for mode in ("off", "probe", "linear"):
        print(f"{mode:>6}: realized KL " + " ".join(f"{v:.4f}" for v in report[mode]["kl_realized"]))
        if mode != "off":
            print(f"{'':>6}  predicted   " + " ".join(f"{v:.4f}" for v in report[mode]["kl_pred"]))
            print(f"{'':>6}  step scale  " + " ".join(f"{v:.4f}" for v in report[mode]["step_scale"]))


if __name__ == "__main__":
    main()
