"""LoGRA checks on 4 gloo ranks, all against a TP=1 reference from the same initial weights:
TP=2 (same sketches, same weights after 3 steps), DP vs the combined batch, PP=2, TP=2xPP=2,
ZeRO-1 vs all-reduce, and a checkpoint saved at TP=2 resumed at TP=1. ZeRO-1 with the overlapped
reduction (per-bucket reduce-scatters started by the backward) against the same buckets reduced
after the backward, and its checkpoint resumed at DP=4 and at DP=1. In bf16: DP replicas stay
bit-identical under stochastic rounding, fp32 masters sharded over DP (ZeRO-1) equal unsharded
ones, and fp32 masters survive a TP=2 -> TP=1 checkpoint."""

import contextlib
import dataclasses
import hashlib

import torch
import torch.distributed as dist
from common import Checks, max_rel, save_then_step

from logra_megatron import parallel
from logra_megatron.checkpoint import load_checkpoint, save_checkpoint
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.models.weights import full_state, gather_full, load_full_state
from logra_megatron.optim.megatron_internals import DISTRIBUTED_CHECKPOINT_METADATA, loading_distributed_adam_state
from logra_megatron.platform.comm_counter import CommCounter
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
STEPS = 3
# Refresh every 2 steps: steps 0 and 2 run the range finder, so the run crosses a basis change.
LOGRA = LogRAConfig(rank=8, refresh_interval=2, oversampling=4)


def settings(distributed=False):
    return OptimizerSettings(kind="logra", lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                             distributed=distributed)


def gathered_sketches(model, optimizer):
    """Full (TP=1-shaped) sketches by global name; collective over TP."""
    out = {}
    for entry in optimizer.weights:
        out[entry.name] = gather_full(entry.sketch.sketch, entry.weight, entry.name)
    return out


def main():
    checks = Checks()
    tokens = torch.randint(0, MODEL.vocab, (8, 17), generator=torch.Generator().manual_seed(3))

    def run(tp, pp, split_batch=False, distributed=False, steps=STEPS, initial=None, probe=None,
            dtype=torch.float32, logra=LOGRA, model_config=MODEL):
        parallel.initialize(tp, pp, seed=77)
        model, ddp, optimizer = build_trainable(model_config, settings(distributed), logra, dtype=dtype)
        load_full_state(model, initial if initial is not None else reference_initial)
        batch = tokens
        if split_batch:
            per = tokens.shape[0] // parallel.dp_size()
            batch = tokens[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]
        first_sketches = None
        for step in range(steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            lm_forward_backward(ddp, batch, micro_batch_size=2)
            if step == 0:
                first_sketches = gathered_sketches(model, optimizer)
                if probe:
                    probe(model, optimizer)
            optimizer.step()
        return model, ddp, optimizer, first_sketches

    # --- TP=1 reference ------------------------------------------------------------------------
    parallel.initialize(1, 1, seed=1)
    from logra_megatron.training.setup import build_trainable as _build

    reference_initial = full_state(_build(MODEL, settings(), LOGRA)[0])
    no_dense_grads = {}

    def record_no_grads(model, optimizer):
        for entry in optimizer.weights:
            weight = entry.weight
            no_dense_grads[entry.name] = (weight.grad is None and not hasattr(weight, "main_grad")
                                          and not weight.requires_grad)

    ref_model, _, ref_opt, ref_sketches = run(1, 1, probe=record_no_grads)
    reference_final = full_state(ref_model)
    checks.results["no_dense_grad_for_sketched_weights"] = no_dense_grads
    checks.results["sketched_weights"] = len(ref_opt.weights)
    checks.results["reference_moved"] = max_rel(reference_final, reference_initial)[0]
    checks.results["refreshes_done"] = ref_opt.refreshes_done

    def compare(tp, pp, **kwargs):
        model, _, optimizer, sketches = run(tp, pp, **kwargs)
        final = full_state(model)
        weight_err, worst = max_rel(final, reference_final)
        result = {"weight_rel_err": weight_err, "worst": worst,
                  "refreshes_done": optimizer.refreshes_done}
        if not kwargs.get("split_batch"):
            result["sketch_rel_err"] = max_rel(
                {k: v for k, v in sketches.items()}, {k: ref_sketches[k] for k in sketches})[0]
        return result

    checks.run("tp2", compare, 2, 1)
    checks.run("dp4_split_batch", compare, 1, 1, split_batch=True)
    checks.run("tp2_dp2_split_batch", compare, 2, 1, split_batch=True)
    checks.run("pp2", compare, 1, 2)
    checks.run("tp2_pp2", compare, 2, 2)
    checks.run("zero1_dp4", compare, 1, 1, split_batch=True, distributed=True)
    checks.run("zero1_tp2_dp2", compare, 2, 1, split_batch=True, distributed=True)

    # --- checkpoint at TP=2 after 2 steps, resume at TP=1 for the 3rd ----------------------------
    ckpt = f"{checks.args.out}/logra_ckpt"

    def save_then_continue():
        model, ddp, optimizer, _ = run(2, 1, steps=2)
        continued.update(save_then_step(ckpt, model, ddp, optimizer, tokens, MODEL))
        return True

    continued = {}
    checks.run("ckpt_save_tp2", save_then_continue)

    def resume_at_tp1():
        parallel.initialize(1, 1, seed=5)
        model, ddp, optimizer = build_trainable(MODEL, settings(), LOGRA)
        extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)}
        loaded = load_checkpoint(ckpt, model, extra_sharded=extra)
        optimizer.load_state_dict(loaded["optimizer"])
        resumed_step = optimizer.step_count
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        optimizer.step()
        error, worst = max_rel(full_state(model), continued)
        return {"weight_rel_err": error, "worst": worst, "resumed_step": resumed_step,
                "vs_reference": max_rel(full_state(model), reference_final)[0]}

    checks.run("ckpt_resume_tp1", resume_at_tp1)

    # --- ZeRO-1 with --overlap-grad-reduce: each rank owns 1/DP of every bucket, whose
    # reduce-scatter the backward starts; against the same buckets reduce-scattered after it ----
    bucket_numel = 2000  # elements: several buckets of the tiny model's sketches at TP=2

    def zero1_overlap(tp, hold, steps=STEPS, split_batch=True, pp=1, logra=LOGRA, model_config=MODEL,
                      initial=None):
        """Steps at ZeRO-1 with overlap; ``hold``: every sketch report held back, so each bucket's
        reduce-scatter starts only after the last backward (the blocking reduction at the same
        buckets). Returns the run and per step: the buckets started before ``step()``."""
        parallel.initialize(tp, pp, seed=77)
        model, ddp, optimizer = build_trainable(model_config, settings(True), logra, overlap_grad_reduce=True,
                                                ddp_bucket_size=bucket_numel)
        load_full_state(model, initial if initial is not None else reference_initial)
        batch = tokens
        if split_batch:
            per = tokens.shape[0] // parallel.dp_size()
            batch = tokens[parallel.dp_rank() * per:(parallel.dp_rank() + 1) * per]
        overlap = optimizer.sketch_buffer.overlap
        started, losses = [], []
        with CommCounter() as comm:
            for _ in range(steps):
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                with overlap.no_sync() if hold else contextlib.nullcontext():
                    losses.append(lm_forward_backward(ddp, batch, micro_batch_size=2))
                started.append(overlap.started)
                optimizer.step()
        return model, ddp, optimizer, {"started": started, "losses": losses, "comm": comm.summary()}

    def rule_state(optimizer):
        return {name: tensor.clone() for name, tensor in optimizer.sketch._full_rule_state().items()}

    def zero1_overlap_vs_blocking(tp):
        model, _, optimizer, overlapped = zero1_overlap(tp, hold=False)
        weights, state = full_state(model), rule_state(optimizer)
        buffer = optimizer.sketch_buffer
        layout = {"buckets": len(buffer.buckets), "dp": buffer.dp,
                  "every_bucket_split_evenly": all(b.shard * buffer.dp == b.end - b.start for b in buffer.buckets),
                  "slice_is_one_part_of_each": buffer.slice_numel == sum(b.shard for b in buffer.buckets),
                  "moved_by_refresh": optimizer.refreshes_done}
        blocking_model, _, blocking_opt, blocking = zero1_overlap(tp, hold=True)
        same = {"losses": overlapped["losses"] == blocking["losses"],
                "weights": all(torch.equal(weights[k], v) for k, v in full_state(blocking_model).items()),
                "rule_state": all(torch.equal(state[k], v) for k, v in rule_state(blocking_opt).items()),
                "comm": overlapped["comm"] == blocking["comm"]}
        reduce_scatter = overlapped["comm"]["by_op"].get("reduce_scatter_tensor", {})
        return {**layout, "started_overlapped": overlapped["started"], "started_blocking": blocking["started"],
                "bit_equal": same, "reduce_scatter": reduce_scatter,
                "vs_reference": max_rel(weights, reference_final)[0]}

    checks.run("zero1_overlap_dp4", zero1_overlap_vs_blocking, 1)
    checks.run("zero1_overlap_tp2_dp2", zero1_overlap_vs_blocking, 2)

    # A checkpoint of the bucketed ZeRO-1 layout (TP=2 x DP=2, full batch on every replica) after
    # 2 steps, resumed at TP=1 x DP=4 (other buckets, other slices) and at TP=2 x PP=2 (DP=1).
    zero1_ckpt = f"{checks.args.out}/logra_zero1_overlap_ckpt"
    zero1_continued = {}

    def zero1_overlap_save_then_continue():
        model, ddp, optimizer, _ = zero1_overlap(2, hold=False, steps=2, split_batch=False)
        # Megatron's distributed optimizer (the dense part) saved per parameter, as the trainer does
        zero1_continued.update(save_then_step(zero1_ckpt, model, ddp, optimizer, tokens, MODEL,
                                              metadata=DISTRIBUTED_CHECKPOINT_METADATA))
        return True

    def zero1_overlap_resume(tp, pp):
        parallel.initialize(tp, pp, seed=5)
        model, ddp, optimizer = build_trainable(MODEL, settings(True), LOGRA, overlap_grad_reduce=True,
                                                ddp_bucket_size=bucket_numel)
        with loading_distributed_adam_state(optimizer):
            extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True,
                                                               metadata=DISTRIBUTED_CHECKPOINT_METADATA)}
            optimizer.load_state_dict(load_checkpoint(zero1_ckpt, model, extra_sharded=extra)["optimizer"])
        resumed_step = optimizer.step_count
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        optimizer.step()
        error, worst = max_rel(full_state(model), zero1_continued)
        return {"weight_rel_err": error, "worst": worst, "resumed_step": resumed_step, "dp": parallel.dp_size(),
                "buckets": len(optimizer.sketch_buffer.buckets)}

    checks.run("zero1_overlap_ckpt_save_tp2_dp2", zero1_overlap_save_then_continue)
    checks.run("zero1_overlap_ckpt_resume_tp1_dp4", zero1_overlap_resume, 1, 1)
    checks.run("zero1_overlap_ckpt_resume_tp2_pp2_dp1", zero1_overlap_resume, 2, 2)

    # --- sketched embeddings (untied and tied) against their own TP=1 reference -------------------
    def embedding_suite(tied):
        model_config = MODEL.with_changes(tie_embeddings=tied)
        logra = dataclasses.replace(LOGRA, embeddings=True)
        parallel.initialize(1, 1, seed=1)
        initial = full_state(_build(model_config, settings(), logra)[0])
        ref_model, _, ref_opt, ref_sketches = run(1, 1, initial=initial, logra=logra, model_config=model_config)
        reference = full_state(ref_model)
        embedding_references[tied] = (initial, reference)
        vocab_names = [e.name for e in ref_opt.weights if e.vocab_rows is not None]
        out = {"vocab_weights": vocab_names, "moved": max_rel(reference, initial)[0]}
        for tp, pp in ((2, 1), (1, 2), (2, 2)):
            model, _, optimizer, sketches = run(tp, pp, initial=initial, logra=logra, model_config=model_config)
            final = full_state(model)
            # Vocabulary padding differs by TP: compare the real rows of the sketches.
            rows = model_config.vocab
            # A tied embedding's two pipeline copies each hold a part of the sketch until the
            # optimizer sums them: compared through the weights only.
            partial = tied and pp > 1
            cut = {k: (v[:rows] if k in vocab_names else v) for k, v in sketches.items()
                   if not (partial and k in vocab_names)}
            ref_cut = {k: (ref_sketches[k][:rows] if k in vocab_names else ref_sketches[k]) for k in cut}
            out[f"tp{tp}_pp{pp}"] = {"weight_rel_err": max_rel(final, reference)[0],
                                     "sketch_rel_err": max_rel(cut, ref_cut)[0],
                                     "sketched_here": sorted(k for k in sketches if k in vocab_names)}
        return out

    embedding_references = {}
    checks.run("embeddings_untied", embedding_suite, False)
    checks.run("embeddings_tied", embedding_suite, True)

    def zero1_overlap_tied_embeddings():
        """Tied, sketched embeddings at PP=2 x DP=2 under ZeRO-1 with the overlapped reduction: the
        embedding has a bucket of its own on both stages, so the stages' reduced parts of it are
        summed after the reduce-scatters."""
        model_config = MODEL.with_changes(tie_embeddings=True)
        initial, reference = embedding_references[True]
        model, _, optimizer, run_info = zero1_overlap(1, hold=False, split_batch=False, pp=2,
                                                      logra=dataclasses.replace(LOGRA, embeddings=True),
                                                      model_config=model_config, initial=initial)
        tied = [entry for entry in optimizer.weights if entry.tied_across_stages]
        return {"weight_rel_err": max_rel(full_state(model), reference)[0], "started": run_info["started"],
                "buckets": len(optimizer.sketch_buffer.buckets),
                "tied_bucket_alone": all(entry.bucket.weights == [entry] for entry in tied), "tied": len(tied)}

    checks.run("zero1_overlap_tied_embeddings_pp2_dp2", zero1_overlap_tied_embeddings)

    # --- bf16 master modes -----------------------------------------------------------------------
    def bf16(master, tp=1, split_batch=True, distributed=False):
        logra = dataclasses.replace(LOGRA, master=master)
        model, _, optimizer, _ = run(tp, 1, split_batch=split_batch, distributed=distributed,
                                     dtype=torch.bfloat16, logra=logra)
        return model, optimizer

    def replicas_identical(master, distributed=False):
        model, optimizer = bf16(master, distributed=distributed)
        state = full_state(model)
        digest = hashlib.sha256(b"".join(state[k].float().numpy().tobytes() for k in sorted(state))).hexdigest()
        digests = [None] * parallel.dp_size()
        dist.all_gather_object(digests, digest, group=parallel.dp_group())
        moved = max_rel({k: v.float() for k, v in state.items()},
                        {k: v.float() for k, v in reference_initial.items()})[0]
        return {"identical": len(set(digests)) == 1, "dp_size": parallel.dp_size(), "moved": moved,
                "master_bytes": optimizer.masters.state_bytes()}

    checks.run("bf16_sr_dp4_replicas", replicas_identical, "bf16-sr")
    checks.run("bf16_fp32_zero1_dp4_replicas", replicas_identical, "fp32", True)

    def sharded_masters_equal_unsharded():
        plain, plain_opt = bf16("fp32")
        plain_state = {k: v.float() for k, v in full_state(plain).items()}
        plain_bytes = plain_opt.masters.state_bytes()
        sharded, sharded_opt = bf16("fp32", distributed=True)
        sharded_state = {k: v.float() for k, v in full_state(sharded).items()}
        error, worst = max_rel(sharded_state, plain_state)
        return {"weight_rel_err": error, "worst": worst,
                "sharded_master_bytes": sharded_opt.masters.state_bytes(), "plain_master_bytes": plain_bytes}

    checks.run("bf16_fp32_master_zero1_vs_plain", sharded_masters_equal_unsharded)

    bf16_ckpt = f"{checks.args.out}/logra_bf16_ckpt"
    continued_bf16 = {}

    def bf16_save_then_continue():
        model, optimizer = bf16("fp32", tp=2, split_batch=False)
        extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict())}
        save_checkpoint(bf16_ckpt, model, MODEL, extra_sharded=extra)
        continued_bf16.update({entry.name: gather_full(optimizer.masters.masters[entry.name], entry.weight, entry.name)
                               for entry in optimizer.weights})
        return True

    def bf16_resume_at_tp1():
        parallel.initialize(1, 1, seed=5)
        model, ddp, optimizer = build_trainable(MODEL, settings(), dataclasses.replace(LOGRA, master="fp32"),
                                                dtype=torch.bfloat16)
        extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)}
        loaded = load_checkpoint(bf16_ckpt, model, extra_sharded=extra)
        optimizer.load_state_dict(loaded["optimizer"])
        masters = {entry.name: optimizer.masters.masters[entry.name] for entry in optimizer.weights}
        # The masters are not the bf16 weights rounded back to fp32: they kept their precision.
        rounded = max_rel({k: v.to(torch.bfloat16).float() for k, v in masters.items()}, masters)[0]
        return {"master_rel_err": max_rel(masters, continued_bf16)[0], "master_vs_rounded": rounded}

    checks.run("bf16_ckpt_save_tp2", bf16_save_then_continue)
    checks.run("bf16_ckpt_resume_tp1", bf16_resume_at_tp1)

    # --- a NaN on one rank at one step: every rank skips it, the next step runs -------------------
    def nan_step_skipped(kind, where, tp, pp):
        parallel.initialize(tp, pp, seed=77)
        optimizer_settings = dataclasses.replace(settings(), kind=kind)
        model, ddp, optimizer = build_trainable(MODEL, optimizer_settings, LOGRA)
        load_full_state(model, reference_initial)
        poisoned_rank = dist.get_world_size() - 1
        outcomes = []
        for step in range(2):
            hook = None
            if step == 0 and dist.get_rank() == poisoned_rank and where == "dense_grad":
                # Before Megatron's grad reduction, as a NaN from the backward would be.
                param = next(p for p in model.parameters() if p.requires_grad)
                hook = param.register_hook(lambda grad: grad * float("nan"))
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            lm_forward_backward(ddp, tokens, micro_batch_size=2)
            if hook is not None:
                hook.remove()
            if step == 0 and dist.get_rank() == poisoned_rank and where == "sketch":
                optimizer.weights[0].sketch.sketch.view(-1)[0] = float("nan")  # before the DP reduction
            before = full_state(model)
            success, grad_norm, _ = optimizer.step()
            outcomes.append({"success": bool(success), "moved": max_rel(full_state(model), before)[0],
                             "finite": all(bool(torch.isfinite(v).all()) for v in full_state(model).values())})
        return outcomes

    for kind, where in (("logra", "sketch"), ("logra", "dense_grad"), ("adam", "dense_grad")):
        for tp, pp in ((2, 2), (1, 1)):
            checks.run(f"nan_{kind}_{where}_tp{tp}_pp{pp}", nan_step_skipped, kind, where, tp, pp)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
