"""Any layout to any layout, on 4 ranks: a model with 4 KV heads (so TP=4 splits it)
saved through the trainer's own checkpoint path (``save_training_state``: model, optimizer and
LoGRA state) at TP=2, TP=4, PP=2 and PP=4, loaded at TP=4, TP=2, PP=4 and PP=2, and stepped on.

For dense Adam and for LoGRA: every layout trains 2 steps from the same initial weights and
saves, then continues 2 steps (the run without resharding); each move loads the source's
checkpoint at another layout and takes the same 2 steps. Those steps must equal the source's
continuation (and the TP=1 reference's): the first uses the loaded moments and, for LoGRA, the
loaded projections; with a refresh every 2 steps, the first resumed step refreshes, so the
second runs on bases the loaded state was carried into. A control loads the weights only
(``load_optim=False``): its next step differs, so the comparison sees the optimizer state.

One move crosses kinds (PP=2 x DP=2 to TP=4 x DP=1). The vocabulary (256) is padded to
128 x TP rows: 256 at TP=2, 512 at TP=4, so the moves to and from TP=4 also cross a change of
padding: of the weights and dense moments (Megatron's ``allow_shape_mismatch``), and of LoGRA's
per-row state of a sketched embedding and output layer (``--logra-embeddings``, a third kind,
moved TP=2 <-> TP=4). Under Megatron's distributed optimizer (ZeRO-1, "_zero1" kinds) the
same TP moves also take the DP-sharded state from DP=2 to DP=1 and back. On 4 gloo ranks on the
CPU, as the suite runs without an accelerator."""

import dataclasses
from types import SimpleNamespace

import torch
from common import Checks, max_rel

from logra_megatron import parallel
from logra_megatron.checkpoint_layout import iteration_dir
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import ModelConfig
from logra_megatron.models.weights import full_state
from logra_megatron.rl.checkpointing import load_training_state, optimizer_compatibility, save_training_state
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

# "tiny" with as many KV heads as query heads: 4 query groups split over TP=4; 4 layers split
# over PP=4. Test-side: no trainer run needs it.
MODEL = ModelConfig(hidden=64, layers=4, heads=4, kv_heads=4, ffn_hidden=128, vocab=256, max_seq=64,
                    family="llama")
VOCAB_WEIGHTS = ("embedding.word_embeddings.weight", "output_layer.weight")
LOGRA = LogRAConfig(rank=8, refresh_interval=2, oversampling=4)
SEED = 1234
SAVED_AT = 2  # steps before the save
RESUMED = 2  # steps after it
LAYOUTS = {"tp2": (2, 1), "tp4": (4, 1), "pp2": (1, 2), "pp4": (1, 4)}
MOVES = (("tp2", "tp4"), ("tp4", "tp2"), ("pp2", "pp4"), ("pp4", "pp2"), ("pp2", "tp4"))
# What each kind saves at and moves between: dense Adam and LoGRA everywhere; LoGRA with the
# embedding and output layer sketched too (--logra-embeddings: per-vocabulary-row state, saved
# cut to the real vocabulary) across the TP moves, where the padding changes.
# Under Megatron's distributed optimizer (--use-distributed-optimizer, "_zero1": the dense Adam
# state, and LoGRA's sketch-space state, sharded over DP) the TP moves change DP too (2 <-> 1).
TP_MOVES = (("tp2", "tp4"), ("tp4", "tp2"))
PLAN = {"adam": (tuple(LAYOUTS), MOVES), "logra": (tuple(LAYOUTS), MOVES),
        "logra_emb": (("tp2", "tp4"), TP_MOVES),
        "adam_zero1": (("tp2", "tp4"), TP_MOVES), "logra_zero1": (("tp2", "tp4"), TP_MOVES)}
CONTROLS = ("adam", "logra")


def dense(kind):
    return kind.startswith("adam")


def logra_config(kind):
    if dense(kind):
        return None
    return dataclasses.replace(LOGRA, embeddings=kind == "logra_emb", zero1=kind.endswith("_zero1"))


def settings(kind):
    return OptimizerSettings(kind="adam" if dense(kind) else "logra", lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                             distributed=kind.endswith("_zero1"))


def compatibility(kind):
    return optimizer_compatibility(SimpleNamespace(optimizer=settings(kind), logra=logra_config(kind) or LOGRA))


def real_rows(state: dict) -> dict:
    """Full tensors with the vocabulary padding (its size depends on TP) cut off."""
    return {k: (v[:MODEL.vocab] if k in VOCAB_WEIGHTS else v).clone() for k, v in state.items()}


def main():
    checks = Checks()
    # The same batch on every rank: the DP replicas (2 at TP=2 or PP=2, 4 at TP=1) agree. Made
    # on the CPU; lm_forward_backward moves it to the model's device.
    tokens = torch.randint(0, MODEL.vocab, (4, 17), generator=torch.Generator().manual_seed(3))
    out = checks.args.out

    def build(kind, layout):
        tp, pp = LAYOUTS[layout] if isinstance(layout, str) else layout
        parallel.initialize(tp, pp, seed=77)
        # Fresh weights are a function of SEED alone, the same at every layout.
        return build_trainable(MODEL, settings(kind), logra_config(kind), seed=SEED)

    def step(ddp, optimizer):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        # vocab_size: the padding stays out of the softmax, so the loss does not depend on TP.
        lm_forward_backward(ddp, tokens, micro_batch_size=2, vocab_size=MODEL.vocab)
        success, _, _ = optimizer.step()
        assert success, "a step was skipped"

    def steps_after(model, ddp, optimizer):
        """The states after each of the RESUMED steps, vocabulary padding cut."""
        states = []
        for _ in range(RESUMED):
            step(ddp, optimizer)
            states.append(real_rows(full_state(model)))
        return states

    def root(kind, layout):
        return f"{out}/{kind}_{layout}"

    saved, continued, reference = {}, {}, {}

    def reference_of(kind):
        return reference[kind.removesuffix("_zero1")]  # ZeRO-1 computes the same steps

    def tp1_reference(kind):
        model, ddp, optimizer = build(kind, (1, 1))
        initial = real_rows(full_state(model))
        for _ in range(SAVED_AT):
            step(ddp, optimizer)
        reference[kind] = steps_after(model, ddp, optimizer)
        return {"moved": max_rel(reference[kind][-1], initial)[0]}

    def save_and_continue(kind, layout):
        model, ddp, optimizer = build(kind, layout)
        for _ in range(SAVED_AT):
            step(ddp, optimizer)
        saved[kind, layout] = real_rows(full_state(model))
        save_training_state(root(kind, layout), model, optimizer, MODEL, {"step": SAVED_AT}, compatibility(kind))
        continued[kind, layout] = steps_after(model, ddp, optimizer)
        return {"vs_tp1": [max_rel(a, b)[0] for a, b in zip(continued[kind, layout], reference_of(kind))]}

    def load_and_step(kind, source, target, load_optim=True):
        model, ddp, optimizer = build(kind, target)
        state = load_training_state(iteration_dir(root(kind, source), SAVED_AT), model, optimizer,
                                    compatibility(kind), load_optim=load_optim)
        loaded = full_state(model)
        result = {"step": state["step"], "loaded_rel_err": max_rel(real_rows(loaded), saved[kind, source])[0],
                  "layout": [parallel.tp_size(), parallel.pp_size(), parallel.dp_size()],
                  "padded_vocab": loaded["embedding.word_embeddings.weight"].shape[0],
                  "query_groups_here": model.decoder.layers[0].self_attention.num_query_groups_per_partition}
        if not dense(kind):
            result["step_count"] = optimizer.step_count
            result["refreshes_done"] = optimizer.refreshes_done
            result["vocab_sketched"] = sorted(e.name for e in optimizer.weights if e.vocab_rows is not None)
        states = steps_after(model, ddp, optimizer)
        result["vs_source"] = [max_rel(a, b)[0] for a, b in zip(states, continued[kind, source])]
        result["vs_tp1"] = [max_rel(a, b)[0] for a, b in zip(states, reference_of(kind))]
        if not dense(kind):
            result["refreshes_after"] = optimizer.refreshes_done
        return result

    for kind, (layouts, moves) in PLAN.items():
        if not kind.endswith("_zero1"):
            checks.run(f"{kind}_tp1", tp1_reference, kind)
        for layout in layouts:
            checks.run(f"{kind}_{layout}_save", save_and_continue, kind, layout)
        for source, target in moves:
            checks.run(f"{kind}_{source}_to_{target}", load_and_step, kind, source, target)
        if kind in CONTROLS:
            checks.run(f"{kind}_tp2_to_tp4_weights_only", load_and_step, kind, "tp2", "tp4", load_optim=False)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
