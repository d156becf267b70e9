"""Rollout checks on 2 ranks, in three layouts from the same full weights: TP=1 (two independent
data-parallel replicas), TP=2 and PP=2. Results are per rank; tests/test_rollout.py asserts.

The reference for greedy decoding is a no-cache loop: every step re-runs the whole sequence
through Megatron's own pipeline schedule (forward only) and takes the argmax of the last logits.
"""

import torch
import torch.distributed as dist

from common import Checks

from logra_megatron import parallel
from logra_megatron.models import build_gpt_model, causal_attention_mask, get_preset, position_ids_for
from logra_megatron.models.weights import full_state, load_full_state
from logra_megatron.rollout.engine import build_rollout_engine
from logra_megatron.rollout.megatron_engine import generate
from logra_megatron.rollout.types import SamplingConfig

PRESET = get_preset("tiny")
NEW = 8
# Different lengths on purpose: a batch of them is left-padded.
PROMPTS = [
    [17, 203, 45],
    [3, 88, 150, 9, 240, 61, 77, 12, 199],
    [250, 1, 64, 128, 33],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=NEW, vocab_size=PRESET.vocab)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=NEW, samples_per_prompt=2,
                         seed=7, vocab_size=PRESET.vocab)


def broadcast_from_last_stage(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    if parallel.pp_size() > 1:
        dist.broadcast(tensor, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
    return int(tensor.item())


@torch.no_grad()
def reference_greedy(model, prompt, new):
    """Greedy continuation without a KV cache: full re-forward through the pipeline schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sequence = list(prompt)
    for _ in range(new):
        tokens = torch.tensor([sequence])

        def step(data_iterator, model):
            batch = next(data_iterator)
            logits = model(batch, position_ids_for(batch), causal_attention_mask(batch.shape[1]),
                           runtime_gather_output=True)
            return logits, lambda out: (out.sum() * 0.0, {"next": out[0, -1, :PRESET.vocab].argmax()})

        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True,
        )
        chosen = int(outputs[0]["next"]) if parallel.is_last_stage() else -1
        sequence.append(broadcast_from_last_stage(chosen))
    return sequence[len(prompt):]


def layout_checks(checks, tag, model, store):
    model.eval()
    reference = checks.run(f"{tag}/reference", lambda: [reference_greedy(model, p, NEW) for p in PROMPTS])
    store[tag] = reference
    # Through the rollout-engine interface, as the trainer samples (--rollout-engine megatron).
    engine = build_rollout_engine("megatron", model)
    checks.run(f"{tag}/greedy_batch", lambda: engine.generate(PROMPTS, GREEDY).completions())
    checks.run(f"{tag}/greedy_alone", lambda: [generate(model, [p], GREEDY).completions()[0] for p in PROMPTS])
    checks.run(f"{tag}/sampled", lambda: generate(model, PROMPTS, SAMPLED).completions())
    checks.run(f"{tag}/sampled_again", lambda: generate(model, PROMPTS, SAMPLED).completions())
    checks.run(f"{tag}/eos", eos_check, model, reference)
    checks.run(f"{tag}/packed_vs_padded", packed_vs_padded, model)


@torch.no_grad()
def packed_vs_padded(model):
    """The packed prefill against the padded one on this layout: the last-token logits (last
    stage) and this rank's real KV-cache slots (largest differences), the attention tokens of
    this rank's layers, and the completions decoded from either (greedy; sampled, G = 2)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from logra_megatron.models.build import unwrap_model
    from logra_megatron.models.positions import rope_positions
    from logra_megatron.rollout.megatron_engine import prefill_packed, prefill_padded
    from logra_megatron.rollout.types import PromptLayout

    layout = PromptLayout.of(PROMPTS, 2, NEW, 0, torch.device("cpu"))
    layers = [m for name, m in unwrap_model(model).named_modules() if name.endswith("core_attention")]
    out = {}
    for pack in (False, True):
        context = StaticInferenceContext(max_batch_size=layout.tokens.shape[0], max_sequence_length=layout.tokens.shape[1])
        calls = []
        handles = [layer.register_forward_pre_hook(
            lambda module, args: calls.append(args[0].numel() // (args[0].shape[-1] * args[0].shape[-2])))
            for layer in layers]
        try:
            if pack:
                logits = prefill_packed(model, layout, 2, context)
            else:
                with rope_positions(model, layout.positions):
                    logits = prefill_padded(model, layout, context)
        finally:
            for handle in handles:
                handle.remove()
        out[pack] = (logits, context, calls)
    real = layout.real[:, :layout.width].t()
    cache_diff = 0.0
    for layer, padded in out[False][1].key_value_memory_dict.items():
        for mine, theirs in zip(out[True][1].key_value_memory_dict[layer], padded):
            cache_diff = max(cache_diff, float((mine[:layout.width][real] - theirs[:layout.width][real]).abs().max()))
    logits_diff = None if out[False][0] is None else float((out[True][0] - out[False][0]).abs().max())
    return {"logits_diff": logits_diff, "cache_diff": cache_diff, "layers": len(layers),
            "packed_tokens": out[True][2], "padded_tokens": out[False][2],
            "real_tokens": sum(len(p) for p in PROMPTS), "padded_cells": layout.tokens.shape[0] * layout.width,
            "greedy": [generate(model, PROMPTS, GREEDY, pack=pack).completions() for pack in (False, True)],
            "sampled": [generate(model, PROMPTS, SAMPLED, pack=pack).completions() for pack in (False, True)]}


def eos_check(model, reference):
    """eos_id = the third greedy token of prompt 0: every row must stop at its first EOS."""
    eos = reference[0][2]
    config = SamplingConfig(temperature=0.0, max_new_tokens=NEW, eos_id=eos, pad_id=0, vocab_size=PRESET.vocab)
    out = generate(model, PROMPTS, config)
    expected = [ref[: ref.index(eos) + 1] if eos in ref else ref for ref in reference]
    width = out.prompt_width
    mask_ok = all(
        out.response_mask[b].nonzero().flatten().tolist() == list(range(width, width + len(expected[b])))
        for b in range(len(PROMPTS))
    )
    padded_ok = all(
        out.tokens[b, width + len(expected[b]):].eq(0).all().item() for b in range(len(PROMPTS))
    )
    alone = generate(model, [PROMPTS[0]], config)  # only row stops early: the loop must end early
    return {
        "completions": out.completions(),
        "expected": expected,
        "finished": out.finished.tolist(),
        "expected_finished": [eos in ref for ref in reference],
        "mask_ok": mask_ok,
        "padded_ok": padded_ok,
        "alone_steps": alone.steps,
        "alone_completion": alone.completions()[0],
        "alone_shape": list(alone.tokens.shape),
    }


def single_layout_checks(checks, model):
    """Layout-independent behaviour, on the TP=1 model."""

    def rows_per_prompt():
        config = SamplingConfig(temperature=1.0, max_new_tokens=4, samples_per_prompt=3, seed=1,
                                vocab_size=PRESET.vocab)
        out = generate(model, PROMPTS, config)
        return {
            "num_sequences": out.num_sequences,
            "prompt_index": out.prompt_index.tolist(),
            "prompts_ok": all(out.prompt(b) == PROMPTS[b // 3] for b in range(out.num_sequences)),
            "shape": list(out.tokens.shape),
            "response_lengths": out.response_lengths.tolist(),
            "attention_ok": all(
                out.attention_mask[b].sum().item() == len(PROMPTS[b // 3]) + out.response_lengths[b].item()
                for b in range(out.num_sequences)
            ),
        }

    def max_new_tokens():
        out = generate(model, PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=5, seed=3,
                                                      vocab_size=PRESET.vocab))
        return {"shape": list(out.tokens.shape), "lengths": out.response_lengths.tolist(),
                "steps": out.steps, "finished": out.finished.tolist()}

    def seeds():
        def run(seed):
            config = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=2, seed=seed,
                                    vocab_size=PRESET.vocab)
            return generate(model, PROMPTS, config).completions()
        return {"a": run(11), "b": run(11), "c": run(12)}

    def top_k_one():
        config = SamplingConfig(temperature=1.3, top_k=1, max_new_tokens=NEW, seed=5, vocab_size=PRESET.vocab)
        return {"top_k_1": generate(model, PROMPTS, config).completions(),
                "greedy": generate(model, PROMPTS, GREEDY).completions()}

    def positions_and_training_mode():
        model.train()
        out = generate(model, PROMPTS[:2], GREEDY)
        width = out.prompt_width
        return {
            "still_training": model.training,
            "positions_row0": out.position_ids[0, : width + 2].tolist(),
            "width": width,
        }

    def bad_prompts():
        from logra_megatron.errors import UserError

        cases = {
            "no prompts": [],
            "empty prompt": [[1, 2], []],
            "token out of range": [[1, 300]],
            "too long": [[1] * 250],
        }
        messages = {}
        for name, prompts in cases.items():
            try:
                generate(model, prompts, GREEDY)
                messages[name] = "no error"
            except UserError as error:
                messages[name] = str(error)
        return messages

    @torch.no_grad()
    def teacher_forced_recompute():
        """The trainer's recipe: one full forward over the left-padded rollout batch, masked with
        padded_causal_mask and positioned with rope_positions, predicts the greedy completion."""
        from logra_megatron.models.positions import padded_causal_mask, rope_positions

        out = generate(model, PROMPTS, GREEDY)
        inputs = out.tokens[:, :-1]
        mask = padded_causal_mask(out.attention_mask[:, :-1])
        with rope_positions(model, out.position_ids[:, :-1]):
            logits = model(inputs, out.position_ids[:, :-1], mask, runtime_gather_output=True)
        plain = model(inputs, out.position_ids[:, :-1], mask, runtime_gather_output=True)
        predicted = logits[:, out.prompt_width - 1:, :PRESET.vocab].argmax(-1)
        targets = out.completion_tokens
        logp = torch.log_softmax(logits.float(), -1).gather(-1, out.tokens[:, 1:, None])[..., 0]
        logp_plain = torch.log_softmax(plain.float(), -1).gather(-1, out.tokens[:, 1:, None])[..., 0]
        response = out.response_mask[:, 1:]
        return {
            "predicted_ok": bool(predicted.eq(targets).all()),
            # Slot-indexed rotary (no shim) equals per-row positions up to rounding: RoPE is relative.
            "shim_vs_slots_max_diff": float((logp - logp_plain)[response].abs().max()),
        }

    checks.run("bad_prompts", bad_prompts)
    checks.run("teacher_forced_recompute", teacher_forced_recompute)
    checks.run("rows_per_prompt", rows_per_prompt)
    checks.run("max_new_tokens", max_new_tokens)
    checks.run("seeds", seeds)
    checks.run("top_k_one", top_k_one)
    checks.run("positions_and_training_mode", positions_and_training_mode)
    model.eval()


def dp_independent(model, reference):
    """At TP=1 on 2 ranks each rank is its own replica: different prompts, batch sizes and stop
    steps must not wait on the other replica."""
    rank = dist.get_rank()
    if rank == 0:
        eos = reference[0][1]
        config = SamplingConfig(temperature=0.0, max_new_tokens=NEW, eos_id=eos, vocab_size=PRESET.vocab)
        out = generate(model, PROMPTS[:1], config)
        expected = [reference[0][: reference[0].index(eos) + 1]]
    else:
        out = generate(model, PROMPTS[1:], GREEDY)
        expected = reference[1:]
    return {"completions": out.completions(), "expected": expected, "steps": out.steps}


def main():
    checks = Checks()
    store = {}

    parallel.initialize(1, 1, seed=1234)
    model = build_gpt_model(PRESET)
    state = [full_state(model)]
    dist.broadcast_object_list(state, src=0)  # both replicas hold rank 0's weights
    state = state[0]
    load_full_state(model, state)
    layout_checks(checks, "tp1", model, store)
    single_layout_checks(checks, model)
    checks.run("dp_independent", dp_independent, model, store["tp1"])

    parallel.initialize(2, 1, seed=99)
    model = build_gpt_model(PRESET)
    load_full_state(model, state)
    layout_checks(checks, "tp2", model, store)

    parallel.initialize(1, 2, seed=99)
    model = build_gpt_model(PRESET)
    load_full_state(model, state)
    layout_checks(checks, "pp2", model, store)

    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
