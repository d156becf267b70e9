"""The Megatron engine's packed prefill against its padded one, at TP1 in fp32 (TP2 and PP2:
tests/workers/rollout_checks.py).

The same left-padded prompt layout (one long prompt, short ones, a one-token prompt; ``G``
samples per prompt) fills the KV cache through the padded ``[B, P]`` block and through the
packed ``[1, t]`` sequence of the distinct prompts: the last-token logits and every real cache
slot agree within 1e-5, and the completions that decode from either cache are identical (greedy,
and sampled with the same seed). The packed prefill sends exactly the distinct prompts' real
tokens through each attention layer, which fails if padding (or the ``G`` copies) comes back;
``pack=False``, ``MegatronEngine(pack_sequences=False)`` and Megatron's unfused attention take
the padded path.
"""

import contextlib

import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext

from logra_megatron import parallel
from logra_megatron.models import build_gpt_model, get_preset
from logra_megatron.models.build import gpt_layer_spec, unwrap_model
from logra_megatron.models.positions import rope_positions
from logra_megatron.rollout.engine import build_rollout_engine
from logra_megatron.rollout.megatron_engine import generate, packs_prefill, prefill_packed, prefill_padded
from logra_megatron.rollout.types import PromptLayout, SamplingConfig

MODEL = get_preset("tiny")
TOL = 1e-5
# one long prompt, short ones, a one-token prompt
PROMPTS = [[17, 203, 45], [3, 88, 150, 9, 240, 61, 77, 12, 199, 4, 4, 31, 90, 2, 18, 77, 5], [250],
           [5, 6, 7, 8, 9], [40, 41]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, vocab_size=MODEL.vocab)


@pytest.fixture(scope="module")
def model():
    parallel.initialize(1, 1, seed=1234)
    model = build_gpt_model(MODEL)
    model.eval()
    return model


@contextlib.contextmanager
def attention_tokens(model):
    """Counts the query tokens every attention layer computes, per call, into the yielded list
    (padded ``[s, b, heads, d]``: ``s x b``; packed ``[t, heads, d]``: ``t``)."""
    calls = []
    layers = [m for name, m in unwrap_model(model).named_modules() if name.endswith("core_attention")]
    handles = [layer.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].numel() // (args[0].shape[-1] * args[0].shape[-2])))
        for layer in layers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _layers(model):
    return sum(1 for name, _ in unwrap_model(model).named_modules() if name.endswith("core_attention"))


def _both_prefills(model, prompts, samples):
    layout = PromptLayout.of(prompts, samples, 4, 0, torch.device("cpu"))
    contexts, logits, counts = {}, {}, {}
    for pack in (False, True):
        context = StaticInferenceContext(max_batch_size=layout.tokens.shape[0], max_sequence_length=layout.tokens.shape[1])
        with torch.no_grad(), attention_tokens(model) as calls:
            if pack:
                logits[pack] = prefill_packed(model, layout, samples, context)
            else:
                with rope_positions(model, layout.positions):
                    logits[pack] = prefill_padded(model, layout, context)
        contexts[pack], counts[pack] = context, calls
    return layout, contexts, logits, counts


@pytest.mark.parametrize("samples", [1, 3])
def test_packed_prefill_matches_the_padded_one(model, samples):
    layout, contexts, logits, _ = _both_prefills(model, PROMPTS, samples)
    assert logits[True].shape == logits[False].shape == (layout.tokens.shape[0], 1, logits[False].shape[-1])
    assert float((logits[True] - logits[False]).abs().max()) < TOL
    real = layout.real[:, :layout.width].t()  # [slots, rows], as the cache is laid out
    assert contexts[True].sequence_len_offset == contexts[False].sequence_len_offset == layout.width
    assert contexts[True].key_value_memory_dict.keys() == contexts[False].key_value_memory_dict.keys()
    for layer, padded in contexts[False].key_value_memory_dict.items():
        packed = contexts[True].key_value_memory_dict[layer]
        for mine, theirs in zip(packed, padded):
            assert mine.shape == theirs.shape
            assert float((mine[:layout.width][real] - theirs[:layout.width][real]).abs().max()) < TOL, layer
            assert mine[:layout.width][~real].eq(0).all()  # padding slots: never computed


@pytest.mark.parametrize("samples", [1, 3])
def test_the_packed_prefill_computes_only_the_distinct_prompts_real_tokens(model, samples):
    layout, _, _, counts = _both_prefills(model, PROMPTS, samples)
    layers = _layers(model)
    real = sum(len(p) for p in PROMPTS)
    assert counts[True] == [real] * layers
    assert counts[False] == [len(PROMPTS) * samples * layout.width] * layers


def test_greedy_completions_identical_packed_and_padded_and_decoding_goes_on(model):
    packed = generate(model, PROMPTS, GREEDY, pack=True)
    padded = generate(model, PROMPTS, GREEDY, pack=False)
    assert packed.completions() == padded.completions()
    assert torch.equal(packed.tokens, padded.tokens) and torch.equal(packed.attention_mask, padded.attention_mask)
    assert packed.steps == GREEDY.max_new_tokens  # decoding ran on after the packed prefill
    # each prompt alone (no padding at all) continues the same way
    alone = [generate(model, [prompt], GREEDY, pack=False).completions()[0] for prompt in PROMPTS]
    assert packed.completions() == alone


def test_sampled_completions_identical_packed_and_padded(model):
    sampled = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=6, samples_per_prompt=3, seed=5,
                             vocab_size=MODEL.vocab)
    assert generate(model, PROMPTS, sampled, pack=True).completions() == \
        generate(model, PROMPTS, sampled, pack=False).completions()


def test_generate_counts_the_real_prompt_tokens_once_then_one_per_row_per_step(model):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, samples_per_prompt=2, seed=1, vocab_size=MODEL.vocab)
    layers, rows = _layers(model), 2 * len(PROMPTS)
    with attention_tokens(model) as calls:
        out = generate(model, PROMPTS, sampling)
    decode_steps = out.steps - 1  # the last sampled token needs no forward
    assert calls == [sum(len(p) for p in PROMPTS)] * layers + [rows] * (layers * decode_steps)


def test_a_single_prompt_and_equal_lengths(model):
    for prompts in ([[7]], [PROMPTS[1]], [[1, 2, 3], [4, 5, 6]]):
        assert generate(model, prompts, GREEDY, pack=True).completions() == \
            generate(model, prompts, GREEDY, pack=False).completions()


def test_engine_option_and_unfused_attention_take_the_padded_path(model):
    layers = _layers(model)
    width = max(len(p) for p in PROMPTS)
    engine = build_rollout_engine("megatron", model, pack_sequences=False)
    with attention_tokens(model) as calls:
        engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=1, vocab_size=MODEL.vocab))
    assert calls == [len(PROMPTS) * width] * layers
    assert packs_prefill(model)
    unfused = build_gpt_model(MODEL, layer_spec=gpt_layer_spec(use_transformer_engine=False,
                                                               attention_backend="unfused"))
    assert not packs_prefill(unfused)
    unfused.load_state_dict(model.state_dict())
    assert generate(unfused, PROMPTS, GREEDY).completions() == generate(model, PROMPTS, GREEDY).completions()
