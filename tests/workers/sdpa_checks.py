"""SDPA core attention against Megatron's unfused DotProductAttention on 2 ranks, at TP=1 (two
data-parallel replicas) and TP=2, from the same full weights: vocab-parallel logits and full
gradients of a masked LM loss on causal and on left-padded batches (the project's mask and
rotary builders), fp32 and bf16, grouped-query (the tiny preset: 4 heads, 2 kv heads) and plain
multi-head attention; and greedy rollouts with the KV cache through the Megatron engine.
tests/test_sdpa_attention.py asserts."""

import torch
from common import Checks
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from logra_megatron import parallel
from logra_megatron.models import build_gpt_model, causal_attention_mask, get_preset, position_ids_for
from logra_megatron.models.build import gpt_layer_spec, transformer_config
from logra_megatron.models.weights import full_state, load_full_state
from logra_megatron.rollout.engine import build_rollout_engine
from logra_megatron.rollout.types import PromptLayout, SamplingConfig
from logra_megatron.training.lm import padded_forward

TINY = get_preset("tiny")
MODELS = {"gqa": TINY, "mha": TINY.with_changes(kv_heads=TINY.heads)}
BACKENDS = ("unfused", "sdpa")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Different lengths on purpose: a batch of them is left-padded (the first rows' first columns
# are padding queries, which attend to no key).
PROMPTS = [[17, 203, 45], [3, 88, 150, 9, 240, 61, 77, 12, 199], [250, 1, 64, 128, 33],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8, vocab_size=TINY.vocab)


def build(model_config, backend, dtype, state):
    config = transformer_config(model_config, parallel.tp_size(), 1, dtype=dtype)
    model = build_gpt_model(model_config, config, gpt_layer_spec(use_transformer_engine=False,
                                                                  attention_backend=backend))
    with torch.no_grad():
        load_full_state(model, state)
    return model


def batches():
    """``{kind: (tokens, real)}``: a causal batch (every token real) and the prompts left-padded."""
    generator = torch.Generator().manual_seed(3)
    causal = torch.randint(0, TINY.vocab, (3, 20), generator=generator)
    layout = PromptLayout.of(PROMPTS, 1, 0, 0, torch.device("cpu"))
    return {"causal": (causal, torch.ones_like(causal, dtype=torch.bool), position_ids_for(causal)),
            "padded": (layout.tokens, layout.real, layout.positions)}


def logits_and_grads(model, kind, tokens, real, positions):
    """This rank's vocab-parallel logits of ``tokens`` and the full gradients of the mean
    next-token loss over real positions (what the project's losses weigh)."""
    model.zero_grad()
    if kind == "causal":
        logits = model(tokens, positions, causal_attention_mask(tokens.shape[1]))
    else:
        logits = padded_forward(model, tokens, real, positions)
    per_token = vocab_parallel_cross_entropy(logits[:, :-1].float().contiguous(), tokens[:, 1:].contiguous())
    weight = (real[:, :-1] & real[:, 1:]).float()
    ((per_token * weight).sum() / weight.sum()).backward()
    return logits.detach().float(), full_state(model, "grad")


def compare(model_name, dtype_name, tp, state):
    """unfused vs sdpa at this layout: logits (max abs difference, relative norm error, whether
    sdpa's are finite) and gradients (largest relative norm error over tensors), per batch."""
    parallel.initialize(tp, 1, seed=99)  # weights come from the load
    model_config, dtype = MODELS[model_name], DTYPES[dtype_name]
    outputs = {backend: {} for backend in BACKENDS}
    for backend in BACKENDS:
        model = build(model_config, backend, dtype, state)
        for kind, batch in batches().items():
            outputs[backend][kind] = logits_and_grads(model, kind, *batch)
    report = {}
    for kind in outputs["sdpa"]:
        (reference, reference_grads), (logits, grads) = outputs["unfused"][kind], outputs["sdpa"][kind]
        errors = {name: float((grads[name].float() - reference_grads[name].float()).norm()
                              / reference_grads[name].float().norm().clamp(min=1e-30)) for name in reference_grads}
        report[kind] = {
            "logits_max_abs": float((logits - reference).abs().max()),
            "logits_rel": float((logits - reference).norm() / reference.norm()),
            "finite": bool(torch.isfinite(logits).all()),
            "grad_max_rel": max(errors.values()),
            "worst_grad": max(errors, key=errors.get),
        }
    return report


def greedy(model_name, tp, state):
    """Greedy completions of the left-padded prompts with the KV cache, per backend."""
    parallel.initialize(tp, 1, seed=99)
    completions = {}
    for backend in BACKENDS:
        model = build(MODELS[model_name], backend, torch.float32, state)
        completions[backend] = build_rollout_engine("megatron", model).generate(PROMPTS, GREEDY).completions()
    return completions


def main():
    checks = Checks()
    states = {}
    for name, model_config in MODELS.items():
        parallel.initialize(1, 1, seed=1234)
        states[name] = full_state(build_gpt_model(model_config))  # the same seed: the same on both ranks
    for tp in (1, 2):
        for name in MODELS:
            for dtype_name in DTYPES:
                checks.run(f"tp{tp}/{name}/{dtype_name}", compare, name, dtype_name, tp, states[name])
            checks.run(f"tp{tp}/{name}/greedy", greedy, name, tp, states[name])
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
