"""Packed against padded GRPO passes at TP=2 and PP=2 (2 gloo ranks, fp32).

At each layout the same ragged rollouts (one long row, many short ones, a one-token row) go
through the padded and the packed passes with the same weights: the old log-probs (agreed over
the pipeline), the loss, and this rank's dense gradients (Adam) or LoGRA sketches and dense
remainder; and the KL controller's forecast on the probe rows packed and padded. Each check
returns the largest differences and the scales they compare against (or both forecasts).
"""

import torch
from common import Checks
from ragged_rollouts import ragged_rollouts as shared_ragged_rollouts

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.rl.grpo import policy_loss_backward, sequence_logprobs
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
PROMPTS = [3, 9, 2, 1, 4, 5, 2, 7, 3, 6]
RESPONSES = [40, 3, 2, 0, 5, 1, 4, 2, 6, 3]


def ragged_rollouts():
    # 10 rows: padded microbatches of 2 (the pipeline sends one shape)
    return shared_ragged_rollouts(PROMPTS, RESPONSES, MODEL.vocab)


def one_side(tp, pp, kind, pack):
    parallel.initialize(tp, pp, seed=7)
    logra = LogRAConfig(rank=8) if kind == "logra" else None
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind=kind, lr=1e-3), logra)
    rollouts = ragged_rollouts()
    old, _ = sequence_logprobs(ddp, rollouts, 2, pack=pack, max_tokens=24)
    shift = 0.3 * torch.sin(torch.arange(old.numel(), dtype=old.dtype)).reshape(old.shape)
    advantages = torch.randn(rollouts.num_sequences, generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = policy_loss_backward(ddp, rollouts, advantages, old + shift, 2, PolicyLossConfig(), pack=pack,
                                   max_tokens=24)
    dense = [p.main_grad.detach().flatten().clone() for p in ddp.parameters()
             if getattr(p, "main_grad", None) is not None]
    sketches = [entry.sketch.sketch.detach().flatten().clone() for entry in getattr(optimizer, "weights", [])]
    real = rollouts.attention_mask[:, :-1] & rollouts.attention_mask[:, 1:]
    return metrics["loss"], old[real], torch.cat(dense) if dense else torch.zeros(0), \
        torch.cat(sketches) if sketches else torch.zeros(0)


def packed_vs_padded(tp, pp, kind):
    padded = one_side(tp, pp, kind, False)
    packed = one_side(tp, pp, kind, True)

    def gap(i):
        return float((packed[i] - padded[i]).abs().max()) if padded[i].numel() else 0.0

    def scale(i):
        return float(padded[i].abs().max()) if padded[i].numel() else 0.0

    return {"loss_diff": abs(packed[0] - padded[0]), "loss": padded[0],
            "logprob_diff": gap(1), "logprob_scale": scale(1),
            "dense_diff": gap(2), "dense_scale": scale(2), "dense_numel": padded[2].numel(),
            "sketch_diff": gap(3), "sketch_scale": scale(3), "sketch_numel": padded[3].numel()}


def probe_packed_vs_padded(tp, pp):
    """The KL controller's forecast (probe mode, cached s = 0 logits) on padded and on packed
    probe rows, after one LoGRA proposal."""
    from logra_megatron.rl.grpo import probe_and_held_out
    from logra_megatron.training.config import KLControlConfig
    from logra_megatron.training.kl_control import PredictedKLController

    parallel.initialize(tp, pp, seed=7)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=1e-3), LogRAConfig(rank=8))
    rollouts = ragged_rollouts()
    old, _ = sequence_logprobs(ddp, rollouts, 2)
    advantages = torch.randn(rollouts.num_sequences, generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    policy_loss_backward(ddp, rollouts, advantages, old + 0.2, 2, PolicyLossConfig())
    optimizer.propose()
    controller = PredictedKLController(KLControlConfig(mode="probe"))
    out = {}
    for pack in (False, True):
        probe, _ = probe_and_held_out(rollouts, 6, 2, MODEL.vocab, pack=pack, max_tokens=24)
        out["packed" if pack else "padded"] = controller.kl(ddp, optimizer, probe, 1.0,
                                                            controller.base_logits(ddp, optimizer, probe))
    return out


def main():
    checks = Checks()
    for tp, pp in ((2, 1), (1, 2)):
        for kind in ("adam", "logra"):
            checks.run(f"tp{tp}pp{pp}/{kind}", packed_vs_padded, tp, pp, kind)
        checks.run(f"tp{tp}pp{pp}/probe", probe_packed_vs_padded, tp, pp)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
