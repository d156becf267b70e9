"""The vLLM rollout engine (logra_megatron/rollout/vllm_engine.py) against the trainer and the
Megatron engine, on a tiny model in fp32, in one process.

The model is the tiny preset with 2 heads of 32 (1 kv head) instead of 4 of 16: vLLM's CPU
attention has no kernel for head dim 16.

One engine serves the whole module (building one takes a few seconds). The tests that need vLLM
skip with a reason when it is not installed; the missing-vLLM error line is checked everywhere
(with vLLM hidden from the child process).
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import REPO
from logra_megatron.errors import UserError
from logra_megatron.models.config import get_preset
from logra_megatron.rollout.engine import check_engine_available
from logra_megatron.rollout.types import SamplingConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e .[rollout])")

VOCAB = 200  # the "tokenizer's" vocabulary: below the preset's 256, so the sync must slice
NEW = 8
PROMPTS = [[17, 103, 45], [3, 88, 150, 9, 140, 61, 77, 12, 199], [50, 1, 64, 128, 33], [5, 6, 7, 8, 9, 10]]
MODEL = get_preset("tiny").with_changes(heads=2, kv_heads=1)
SET_NUM_THREADS = torch.set_num_threads
INIT_STD = 0.3
"""Larger than the usual 0.02: decisive next-token distributions, so greedy decoding in the two
engines does not hinge on rounding-level ties between logits."""


# --- without vLLM: one clean line -----------------------------------------------------------

HIDE_VLLM = "import sys; sys.modules['vllm'] = None; "


def test_missing_vllm_is_one_error_line_from_the_trainer():
    code = HIDE_VLLM + ("from logra_megatron.train import main; "
                        "main(['--rollout-engine', 'vllm', '--train-iters', '1', '--no-progress'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: --rollout-engine vllm needs the 'vllm' package, which is not installed; "
                     "install it with: pip install -e .[rollout]"], proc.stderr[-2000:]


def test_missing_vllm_is_a_user_error_when_the_engine_first_runs(monkeypatch):
    from logra_megatron.rollout.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(UserError, match=r"pip install -e \.\[rollout\]"):
        import_vllm()
    with pytest.raises(UserError, match="not installed"):
        check_engine_available("vllm")
    check_engine_available("megatron")  # needs nothing beyond the package


# --- with vLLM ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup():
    """(model, vLLM engine, Megatron engine) on one tiny fp32 model."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install -e .[rollout])")
    from logra_megatron import parallel
    from logra_megatron.models import build_gpt_model, gpt_layer_spec, transformer_config
    from logra_megatron.models.weights import initialize_layout_independent
    from logra_megatron.rollout.engine import build_rollout_engine

    parallel.initialize(1, 1, seed=1234)
    model = build_gpt_model(MODEL, transformer_config(MODEL), gpt_layer_spec(use_transformer_engine=False))
    initialize_layout_independent(model, VOCAB, seed=5, init_std=INIT_STD)
    engine = build_rollout_engine("vllm", model, model_config=MODEL, vocab_size=VOCAB, sync_bucket_mb=1)
    megatron = build_rollout_engine("megatron", model)
    yield model, engine, megatron
    engine.close()


def greedy(**changes):
    return SamplingConfig(**{"temperature": 0.0, "max_new_tokens": NEW, "vocab_size": VOCAB, **changes})


def trainer_logprobs(model, rollouts, temperature=1.0):
    """The trainer's own log-probs of the sampled tokens, at their columns (0 elsewhere)."""
    from logra_megatron.rl.grpo import sequence_logprobs

    logprobs, _ = sequence_logprobs(model, rollouts, rollouts.num_sequences, temperature, VOCAB)
    full = torch.zeros_like(rollouts.tokens, dtype=torch.float32)
    full[:, 1:] = logprobs
    return full * rollouts.response_mask


@needs_vllm
def test_greedy_rollouts_are_token_identical_to_the_megatron_engine(setup):
    _model, engine, megatron = setup
    ours, theirs = engine.generate(PROMPTS, greedy()), megatron.generate(PROMPTS, greedy())
    assert ours.completions() == theirs.completions()
    for name in ("tokens", "attention_mask", "response_mask", "position_ids", "prompt_lengths",
                 "response_lengths", "finished", "prompt_index"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert (ours.prompt_width, ours.steps) == (theirs.prompt_width, theirs.steps)
    assert len(set(map(tuple, ours.completions()))) > 1  # the prompts continue differently
    assert torch.set_num_threads is SET_NUM_THREADS  # vLLM's worker replaces it; the engine restores it


@needs_vllm
def test_logprobs_after_a_full_sync_equal_the_trainers(setup):
    model, engine, _megatron = setup
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=2, vocab_size=VOCAB, seed=3)
    before = engine.generate(PROMPTS, sampling)
    with torch.no_grad():  # a training step's worth of change
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    measured = engine.sync_weights(model)
    after = engine.generate(PROMPTS, sampling)
    mask = after.response_mask
    reference = trainer_logprobs(model, after)
    assert torch.allclose(after.logprobs * mask, reference, atol=1e-4, rtol=0), \
        float((after.logprobs * mask - reference).abs().max())
    assert float(reference.abs().sum()) > 1.0
    # The sync moved the weights: the engine's log-probs of the old samples changed with them.
    stale = trainer_logprobs(model, before)
    assert not torch.allclose(before.logprobs * before.response_mask, stale, atol=1e-3)
    # Every parameter was handed over once, in the engine's dtype (fp32), with the embedding and
    # output layer sliced to the 200-token vocabulary.
    assert measured["sync_bytes"] == 4 * MODEL.with_changes(vocab=VOCAB).num_parameters()
    assert measured["sync_time_s"] > 0


@needs_vllm
def test_top_k_one_is_greedy(setup):
    _model, engine, _megatron = setup
    top1 = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=NEW, vocab_size=VOCAB, seed=11)
    assert engine.generate(PROMPTS, top1).completions() == engine.generate(PROMPTS, greedy()).completions()


@needs_vllm
def test_samples_per_prompt_are_rows_in_prompt_major_order(setup):
    _model, engine, _megatron = setup
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=3, vocab_size=VOCAB, seed=4)
    rollouts = engine.generate(PROMPTS, sampling)
    assert rollouts.num_sequences == 3 * len(PROMPTS)
    assert rollouts.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for row in range(rollouts.num_sequences):
        assert rollouts.prompt(row) == PROMPTS[row // 3]
    assert len(set(map(tuple, rollouts.completions()))) > len(PROMPTS)  # samples differ within a group


@needs_vllm
def test_greedy_with_several_samples_per_prompt_repeats_the_greedy_row(setup):
    _model, engine, megatron = setup
    ours = engine.generate(PROMPTS, greedy(samples_per_prompt=2))
    assert ours.completions() == megatron.generate(PROMPTS, greedy(samples_per_prompt=2)).completions()
    single = engine.generate(PROMPTS, greedy()).completions()
    assert ours.completions() == [row for row in single for _ in range(2)]


@needs_vllm
def test_same_seed_same_samples_other_seed_other_samples(setup):
    _model, engine, _megatron = setup
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=2, vocab_size=VOCAB, seed=9)
    first = engine.generate(PROMPTS, sampling).completions()
    assert engine.generate(PROMPTS, sampling).completions() == first
    other = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=2, vocab_size=VOCAB, seed=10)
    assert engine.generate(PROMPTS, other).completions() != first


@needs_vllm
def test_eos_stops_a_row_like_the_megatron_engine(setup):
    _model, engine, megatron = setup
    free = engine.generate(PROMPTS, greedy())
    eos = free.completion(1)[2]  # the third token prompt 1 generates greedily
    ours, theirs = engine.generate(PROMPTS, greedy(eos_id=eos)), megatron.generate(PROMPTS, greedy(eos_id=eos))
    assert ours.completion(1) == free.completion(1)[:3]
    assert bool(ours.finished[1]) and int(ours.response_lengths[1]) == 3
    assert ours.completions() == theirs.completions()
    assert torch.equal(ours.finished, theirs.finished)
    assert torch.equal(ours.tokens, theirs.tokens)  # pad_id after EOS, as the Megatron engine writes


@needs_vllm
def test_tied_embeddings_logprobs_equal_the_trainers_after_a_sync(setup):
    """A policy whose output layer is its embedding (SmolLM2, Qwen2.5 small): the engine must
    follow both after a sync (vLLM's CPU backend does not when they are tied in the engine)."""
    from logra_megatron.models import build_gpt_model, gpt_layer_spec, transformer_config
    from logra_megatron.models.weights import initialize_layout_independent
    from logra_megatron.rollout.vllm_engine import VLLMEngine

    tied = MODEL.with_changes(tie_embeddings=True)
    model = build_gpt_model(tied, transformer_config(tied), gpt_layer_spec(use_transformer_engine=False))
    initialize_layout_independent(model, VOCAB, seed=6, init_std=INIT_STD)
    engine = VLLMEngine(model, model_config=tied, vocab_size=VOCAB)
    try:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, samples_per_prompt=2, vocab_size=VOCAB, seed=5)
        engine.generate(PROMPTS, sampling)  # builds the engine with the initial weights
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        measured = engine.sync_weights(model)
        rollouts = engine.generate(PROMPTS, sampling)
        reference = trainer_logprobs(model, rollouts)
        assert torch.allclose(rollouts.logprobs * rollouts.response_mask, reference, atol=1e-4, rtol=0)
        # The embedding travels twice on CPU (it is the engine's output layer as well).
        assert measured["sync_bytes"] == 4 * (tied.with_changes(vocab=VOCAB).num_parameters() + VOCAB * 64)
    finally:
        engine.close()


@needs_vllm
def test_closing_keeps_the_trainers_process_group_and_the_engine_rebuilds(setup):
    import torch.distributed as dist

    _model, engine, megatron = setup
    engine.close()  # vLLM's own teardown would destroy the default process group
    assert dist.is_initialized()
    dist.barrier()
    assert engine.llm is None
    # The next call builds a fresh engine and sends the weights again.
    assert engine.generate(PROMPTS, greedy()).completions() == megatron.generate(PROMPTS, greedy()).completions()
    assert engine.last_sync["sync_bytes"] > 0


@needs_vllm
def test_the_embedded_default_gets_heads_vllm_serves_on_cpu():
    """``--rollout-engine vllm`` alone on the tiny preset (heads of 16, which vLLM's CPU attention
    has no kernel for) widens its heads to 32, says so, and leaves explicit heads and the
    Megatron engine's model alone."""
    from logra_megatron.config import parse_train_args
    from logra_megatron.rl.config import widened_heads_line

    default = parse_train_args([], world_size=1).model_config
    widened = parse_train_args(["--rollout-engine", "vllm"], world_size=1)
    assert (default.heads, default.kv_channels) == (4, 16)
    assert (widened.model_config.heads, widened.model_config.kv_heads, widened.model_config.kv_channels) == (2, 2, 32)
    assert "2 attention heads of 32 instead of 4 of 16" in widened_heads_line(widened)
    explicit = parse_train_args(["--rollout-engine", "vllm", "--num-attention-heads", "4"], world_size=1)
    assert explicit.model_config.heads == 4 and widened_heads_line(explicit) is None
    smollm2 = parse_train_args(["--rollout-engine", "vllm", "--preset", "smollm2-135m"], world_size=1)
    assert smollm2.model_config.heads == 9  # head dim 64: served as it is
