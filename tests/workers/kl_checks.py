"""Predicted-KL control across ranks (4 gloo ranks): at TP=2, PP=2 and DP=4 every rank applies
the same step scale and data-parallel replicas hold bitwise-identical weights afterwards; the
copy-free forecast (side paths, no weight copy) equals the exact one (weights set to W + s D)
at TP=1, TP=2 and PP=2, with sketched embeddings; under PP=2 (and its interleaved schedule) the
probe's parts go through one schedule call a forward pass and forecast what one pass per part
does, padded and packed."""


import hashlib

import torch
import torch.distributed as dist
from common import Checks
from ragged_rollouts import ragged_rollouts

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.training.config import KLControlConfig
from logra_megatron.ops.vocab_parallel import masked_half_variance_sum, masked_kl_sum
from logra_megatron.rl.grpo import probe_set
from logra_megatron.training import lm
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
from logra_megatron.models import get_preset
from logra_megatron.models.weights import full_state
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")


def main():
    checks = Checks()
    tokens = torch.randint(0, MODEL.vocab, (8, 33), generator=torch.Generator().manual_seed(4))

    def run(tp, pp, mode):
        parallel.initialize(tp, pp, seed=9)
        model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                                LogRAConfig(rank=16, refresh_interval=5))
        controller = PredictedKLController(KLControlConfig(mode=mode, target=0.02))
        per = tokens.shape[0] // parallel.dp_size()
        batch = tokens[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]
        scales, predicted = [], []
        for _ in range(2):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            lm_forward_backward(ddp, batch, micro_batch_size=1)
            metrics = controller.step(ddp, optimizer, ProbeSet(batch[:1], torch.ones(1, batch.shape[1])))
            scales.append(metrics["step_scale"])
            predicted.append(metrics["kl_pred"])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (scales, predicted))
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for _, t in sorted(full_state(model).items()))).hexdigest()
        replicas = [None] * parallel.dp_size()
        dist.all_gather_object(replicas, digest, group=parallel.dp_group())
        return {"scales": scales, "all_ranks_agree": all(item == everyone[0] for item in everyone),
                "dp_replicas_identical": len(set(replicas)) == 1, "dp_size": parallel.dp_size()}

    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        for mode in ("probe", "linear"):
            checks.run(f"{mode}_tp{tp}_pp{pp}", run, tp, pp, mode)

    def copy_free_vs_exact(tp, pp, scale=0.5):
        parallel.initialize(tp, pp, seed=9)
        logra = LogRAConfig(rank=16, refresh_interval=5, embeddings=True)
        model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2, weight_decay=0.1),
                                                logra)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        optimizer.propose()
        probe = ProbeSet(tokens[:3], torch.ones(3, tokens.shape[1]), micro_batch_size=2)
        controller = PredictedKLController(KLControlConfig(mode="probe", target=0.02))
        copy_free = controller.kl(ddp, optimizer, probe, scale)
        # Exact: the sketched weights set to W + s D in full, the dense remainder previewed.
        old = [probe.logits(ddp, part) for part in probe.parts()]
        proposal = optimizer.sketch.proposal
        saved = [entry.weight.detach().clone() for entry in optimizer.weights]
        with torch.no_grad():
            for entry in optimizer.weights:
                step = scale * proposal.lr
                full = entry.sketch.update_from(entry.view(proposal.update))
                entry.weight.mul_(1 - step * proposal.weight_decay).sub_(step * full)
        optimizer.preview(scale)
        optimizer.sketch.preview(0.0)  # the dense remainder only: no side paths
        total = 0.0
        for part, before in zip(probe.parts(), old):
            after = probe.logits(ddp, part)
            if parallel.is_last_stage():
                total += masked_kl_sum(before, after, probe.mask[part])
        optimizer.preview(0.0)
        with torch.no_grad():
            for entry, weight in zip(optimizer.weights, saved):
                entry.weight.copy_(weight)
        exact = parallel.agree_on_scalar(total / float(probe.mask.sum()))
        return {"copy_free": copy_free, "exact": exact, "rel_diff": abs(copy_free - exact) / exact}

    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        checks.run(f"copy_free_tp{tp}_pp{pp}", copy_free_vs_exact, tp, pp)
    def probe_through_pipeline(virtual):
        """The forecast (probe and linear) with the probe's parts as one schedule call's
        microbatches, against one call per part (the reference: what the controller did before);
        and the schedule calls a forecast makes."""
        parallel.initialize(1, 2, seed=9, virtual_pipeline=virtual)
        _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                            LogRAConfig(rank=16, refresh_interval=5))
        for chunk in lm.model_chunks(ddp):
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        optimizer.propose()
        rollouts = ragged_rollouts([5, 9, 3, 7, 6, 4], [11, 4, 9, 8, 2, 6], MODEL.vocab, seed=3)
        rows = torch.arange(6)
        probes = {"padded": probe_set(rollouts, rows, 2, MODEL.vocab),
                  "packed": probe_set(rollouts, rows, 2, MODEL.vocab, pack=True, max_tokens=24)}
        calls = [0]
        schedule = lm.get_forward_backward_func

        def counting_schedule():
            calls[0] += 1
            return schedule()

        lm.get_forward_backward_func = counting_schedule
        report = {}
        try:
            for name, probe in probes.items():
                parts = probe.parts()
                lengths = sorted({int(p[0].real_tokens) for p in probe.packed}) if probe.packed else None
                controller = PredictedKLController(KLControlConfig(mode="probe", target=0.02))
                calls[0] = 0
                forecast = controller.kl(ddp, optimizer, probe, 0.5)
                forecast_calls = calls[0]
                linear_controller = PredictedKLController(KLControlConfig(mode="linear", target=0.02))
                calls[0] = 0
                linear = linear_controller.linear_kl(ddp, optimizer, probe)
                linear_calls = calls[0]
                # One call per part, each part's logits whole.
                optimizer.preview(0.0)
                old = [probe.logits(ddp, part) for part in parts]
                calls[0] = 0
                optimizer.preview(0.5)
                new = [probe.logits(ddp, part) for part in parts]
                reference_calls = calls[0]
                epsilon = linear_controller.config.linear_epsilon
                optimizer.preview(epsilon)
                moved = [probe.logits(ddp, part) for part in parts]
                optimizer.preview(0.0)
                total = half = 0.0
                if parallel.is_last_stage():
                    for part, before, after, step in zip(parts, old, new, moved):
                        total += masked_kl_sum(before, after, probe.part_mask(part))
                        half += masked_half_variance_sum(before, step, epsilon, probe.part_mask(part))
                report[name] = {"parts": len(parts), "packed_real_lengths": lengths,
                                "forecast": forecast, "reference": controller._mean(total, probe),
                                "linear": linear, "linear_reference": linear_controller._mean(half, probe),
                                "forecast_schedule_calls": forecast_calls, "linear_schedule_calls": linear_calls,
                                "reference_schedule_calls": reference_calls}
        finally:
            lm.get_forward_backward_func = schedule
        return report

    for virtual in (None, 2):
        checks.run(f"probe_through_pipeline_vpp{virtual or 1}", probe_through_pipeline, virtual)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
