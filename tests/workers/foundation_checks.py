"""Foundation checks on 4 gloo ranks: TP=2, PP=2 and TP=2xPP=2 against TP=1 from the same
weights (loss and full-shape gradients, through Megatron's pipeline schedule with 4
microbatches), and a dist checkpoint saved at TP=2 loaded at TP=1, PP=2 and TP=2xPP=2."""

import torch
from common import Checks

from logra_megatron import parallel
from logra_megatron.checkpoint import load_checkpoint, save_checkpoint
from logra_megatron.models import build_gpt_model, get_preset
from logra_megatron.models.weights import full_state, initialize_layout_independent, load_full_state
from logra_megatron.convert.runtime import full_vocab_logits
from logra_megatron.training.lm import lm_forward_backward



def main():
    checks = Checks()
    MODEL = get_preset("tiny")
    BATCH, SEQ = 8, 17
    tokens = torch.randint(0, MODEL.vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))

    def forward_logits(model, inputs):
        """Full-vocabulary logits [b, s, V] on the last stage (None elsewhere)."""
        return full_vocab_logits(model, inputs, MODEL.vocab)

    def rel_err(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-30))


    # --- TP=1 reference --------------------------------------------------------------------------
    parallel.initialize(1, 1, seed=1234)
    reference = build_gpt_model(MODEL)
    reference_params = full_state(reference)
    reference_loss = lm_forward_backward(reference, tokens, micro_batch_size=BATCH)
    reference_grads = full_state(reference, "grad")
    reference_logits = forward_logits(reference, tokens[:, :-1])
    checks.results["reference_loss"] = reference_loss
    checks.results["num_tensors"] = len(reference_params)

    def compare_layout(tp, pp):
        parallel.initialize(tp, pp, seed=99)  # a different seed: weights must come from the load
        model = build_gpt_model(MODEL)
        load_full_state(model, reference_params)
        loss = lm_forward_backward(model, tokens, micro_batch_size=2)  # 4 microbatches
        grads = full_state(model, "grad")
        missing = sorted(set(reference_grads) ^ set(grads))
        errors = {name: rel_err(grads[name], reference_grads[name]) for name in reference_grads}
        return {
            "loss": loss,
            "loss_rel_err": abs(loss - reference_loss) / abs(reference_loss),
            "grad_max_rel_err": max(errors.values()),
            "worst_tensor": max(errors, key=errors.get),
            "name_mismatch": missing,
        }


    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        checks.run(f"exact_tp{tp}_pp{pp}", compare_layout, tp, pp)


    # --- fresh weights: the same at every layout (drawn on the process's device) -------------------
    def fresh(tp, pp):
        parallel.initialize(tp, pp, seed=3)
        model = build_gpt_model(MODEL)
        initialize_layout_independent(model, MODEL.vocab, seed=21)
        return full_state(model)

    fresh_tp1 = fresh(1, 1)

    def compare_fresh(tp, pp):
        state = fresh(tp, pp)
        return {"names_equal": sorted(state) == sorted(fresh_tp1),
                "max_abs_diff": max(float((state[name] - fresh_tp1[name]).abs().max()) for name in fresh_tp1),
                "device": str(next(iter(state.values())).device)}

    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        checks.run(f"fresh_tp{tp}_pp{pp}", compare_fresh, tp, pp)


    # --- dist checkpointing: save at TP=2, load elsewhere --------------------------------------------
    ckpt_dir = f"{checks.args.out}/ckpt_tp2"

    def save_at_tp2():
        parallel.initialize(2, 1, seed=5)
        model = build_gpt_model(MODEL)
        load_full_state(model, reference_params)
        save_checkpoint(ckpt_dir, model, MODEL)
        return True

    def load_and_compare(tp, pp):
        parallel.initialize(tp, pp, seed=11)
        model = build_gpt_model(MODEL)
        before = forward_logits(model, tokens[:, :-1])
        load_checkpoint(ckpt_dir, model)
        logits = forward_logits(model, tokens[:, :-1])
        if logits is None:
            return {"last_stage": False}
        return {
            "last_stage": True,
            "max_abs_diff": float((logits - reference_logits).abs().max()),
            "diff_before_load": float((before - reference_logits).abs().max()),
        }


    checks.run("ckpt_save_tp2", save_at_tp2)
    for tp, pp in ((1, 1), (1, 2), (2, 2), (2, 1)):
        checks.run(f"ckpt_load_tp{tp}_pp{pp}", load_and_compare, tp, pp)

    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
