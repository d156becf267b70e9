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


def parse_args(argv):
    parser = ArgumentParser(prog="kl_control_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-2, help="deliberately large")
    parser.add_argument("--kl-target", type=float, default=0.02)
    parser.add_argument("--kl-probe-sequences", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def run_mode(mode, args, tokens):
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.training.config import KLControlConfig
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.models import get_preset
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.config import OptimizerSettings
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

    from logra_megatron.training.config import KLControlConfig

    KLControlConfig(mode="probe", target=args.kl_target, probe_sequences=args.kl_probe_sequences)
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
