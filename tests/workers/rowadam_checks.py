"""RowAdam (``--logra-update rowadam``) checks on 2 gloo ranks, against a TP=1 run from the same
initial weights on the same batch: TP=2, PP=2 and DP=2 (the batch split) give the same updates;
the projection is redrawn every step and is the same on every rank that uses it; a checkpoint
written at TP=2 after two steps resumes at TP=1 with the same third step; bf16 weights train
with fp32 masters and with stochastic rounding, DP replicas staying identical."""

import dataclasses
import hashlib

import torch
import torch.distributed as dist
from common import Checks, save_then_step

from logra_megatron import parallel
from logra_megatron.checkpoint import load_checkpoint
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.models.weights import full_state, load_full_state
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
STEPS = 3
# A large relative step, so that a step's change of a weight is far above fp32 rounding of the
# weight and the updates themselves can be compared closely.
LOGRA = LogRAConfig(rank=8, update="rowadam", rowadam_step=1e-2)
SETTINGS = OptimizerSettings(kind="logra", lr=1e-3, weight_decay=0.01, clip_grad=1.0)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def rel(a: dict, b: dict, names=None):
    names = list(b) if names is None else names
    errors = {k: float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30)) for k in names}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def main():
    checks = Checks()
    tokens = torch.randint(0, MODEL.vocab, (8, 17), generator=torch.Generator().manual_seed(3))
    parallel.initialize(1, 1, seed=1)
    initial = full_state(build_trainable(MODEL, SETTINGS, LOGRA)[0])

    def run(tp, pp, split_batch=False, steps=STEPS, logra=LOGRA, dtype=torch.float32, after_steps=None):
        parallel.initialize(tp, pp, seed=77)
        model, ddp, optimizer = build_trainable(MODEL, SETTINGS, logra, dtype=dtype)
        load_full_state(model, initial)
        batch = tokens
        if split_batch:
            per = tokens.shape[0] // parallel.dp_size()
            batch = tokens[parallel.dp_rank() * per:(parallel.dp_rank() + 1) * per]
        projections = []
        for _ in range(steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            lm_forward_backward(ddp, batch, micro_batch_size=2)
            projections.append({entry.name: digest(entry.sketch.projection) for entry in optimizer.weights})
            optimizer.step()
        if after_steps is not None:
            after_steps(model, ddp, optimizer, batch)
        return model, optimizer, projections

    ref_model, ref_opt, ref_projections = run(1, 1)
    reference = full_state(ref_model)
    sketched = [entry.name for entry in ref_opt.weights]
    ref_updates = {k: reference[k] - initial[k] for k in sketched}

    def signs_only():
        r = ref_opt.weights[0].sketch.rank
        return {entry.name: bool((entry.sketch.projection.abs() - r**-0.5).abs().max() < 1e-7)
                for entry in ref_opt.weights}

    checks.results["reference"] = {
        "moved": rel(reference, initial)[0],
        "smallest_update": min(float(u.norm() / initial[k].norm()) for k, u in ref_updates.items()),
        "refreshes_done": ref_opt.refreshes_done,
        "projections_are_signs": signs_only(),
        "distinct_per_step": {name: len({step[name] for step in ref_projections}) for name in sketched},
        "line_state_numel": ref_opt.update_rule.state()["line_exp_avg_sq"].numel(),
        "line_state_nonzero": bool(ref_opt.update_rule.state()["line_exp_avg_sq"].abs().sum() > 0),
    }

    def same_projections(projections):
        """Every projection this rank used equals the TP=1 run's for the same weight and step,
        and every rank of the world used the same one."""
        mine = [{name: value for name, value in step.items()} for step in projections]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        agree_with_reference = all(step[name] == ref_projections[k][name]
                                   for k, step in enumerate(mine) for name in step)
        agree_across_ranks = all(other[k][name] == step[name] for other in everyone
                                 for k, step in enumerate(mine) for name in step if name in other[k])
        return agree_with_reference, agree_across_ranks

    def compare(tp, pp, **kwargs):
        model, optimizer, projections = run(tp, pp, **kwargs)
        final = full_state(model)
        with_reference, across_ranks = same_projections(projections)
        updates = {k: final[k] - initial[k] for k in sketched}
        return {"weight_rel_err": rel(final, reference)[0],
                "update_rel_err": rel(updates, ref_updates)[0],
                "smallest_update": min(float(u.norm() / initial[k].norm()) for k, u in updates.items()),
                "projections_as_tp1": with_reference, "projections_same_on_all_ranks": across_ranks}

    checks.run("tp2", compare, 2, 1)
    checks.run("pp2", compare, 1, 2)
    checks.run("dp2_split_batch", compare, 1, 1, split_batch=True)

    # --- a checkpoint at TP=2 after 2 steps, resumed at TP=1 for the 3rd --------------------------
    ckpt = f"{checks.args.out}/rowadam_ckpt"
    continued = {}

    def save_and_continue(model, ddp, optimizer, batch):
        continued.update(save_then_step(ckpt, model, ddp, optimizer, batch, MODEL))

    def resume_at_tp1():
        run(2, 1, steps=2, after_steps=save_and_continue)
        parallel.initialize(1, 1, seed=5)
        model, ddp, optimizer = build_trainable(MODEL, SETTINGS, LOGRA)
        extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)}
        optimizer.load_state_dict(load_checkpoint(ckpt, model, extra_sharded=extra)["optimizer"])
        loaded = {"step_count": optimizer.step_count, "refreshes_done": optimizer.refreshes_done,
                  "line_state_nonzero": bool(optimizer.update_rule.state()["line_exp_avg_sq"].abs().sum() > 0)}
        before = full_state(model)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        optimizer.step()
        after = full_state(model)
        steps = {k: after[k] - before[k] for k in sketched}
        expected = {k: continued[k] - before[k] for k in sketched}
        return dict(loaded, weight_rel_err=rel(after, continued)[0], step_rel_err=rel(steps, expected)[0],
                    vs_reference=rel(after, reference)[0])

    checks.run("ckpt_tp2_resume_tp1", resume_at_tp1)

    # --- bf16 weights: both master modes train; DP replicas stay identical -------------------------
    def bf16(master):
        model, optimizer, _ = run(1, 1, split_batch=True, dtype=torch.bfloat16,
                                  logra=dataclasses.replace(LOGRA, master=master))
        state = full_state(model)
        mine = hashlib.sha256(b"".join(state[k].float().numpy().tobytes() for k in sorted(state))).hexdigest()
        digests = [None] * parallel.dp_size()
        dist.all_gather_object(digests, mine, group=parallel.dp_group())
        updates = {k: state[k].float() - initial[k].to(torch.bfloat16).float() for k in sketched}
        return {"replicas_identical": len(set(digests)) == 1, "dp_size": parallel.dp_size(),
                "finite": all(bool(torch.isfinite(v.float()).all()) for v in state.values()),
                "smallest_update": min(float(u.norm() / initial[k].norm()) for k, u in updates.items()),
                "update_rel_err_vs_fp32": rel(updates, ref_updates)[0],
                "master_bytes": optimizer.masters.state_bytes()}

    checks.run("bf16_fp32_masters", bf16, "fp32")
    checks.run("bf16_sr", bf16, "bf16-sr")
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
