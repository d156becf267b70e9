"""Low-rank policy sync into the vLLM engine (``--policy-sync lowrank``;
logra_megatron/rollout/policy_update.py, vllm_worker.py, vllm_engine.py) on LoGRA runs in fp32,
in one process: the engine's log-probs of fixed token sequences follow the trainer's through
syncs that cross projection refreshes, the bytes a low-rank sync sends are measured against a
full sync's, k low-rank syncs leave the engine where one full sync of the same weights does, and
an engine that fails mid-sync is rebuilt with a full sync.

The tiny model has 2 heads of 32 (1 kv head): vLLM's CPU attention has no kernel for the
preset's head dim 16. Skips with a reason without vLLM (the commit log and the message are
tested without it in tests/test_policy_update.py).
"""

import importlib.util

import pytest
import torch

from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models.config import get_preset
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.training.config import OptimizerSettings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e .[rollout])")

VOCAB = 99  # the embedded default's tokenizer (SentencePiece on the task corpus)
MODEL = get_preset("tiny").with_changes(heads=2, kv_heads=1)
PROMPTS = [[17, 83, 45], [3, 88, 50, 9, 40, 61, 77, 12, 98], [50, 1, 64, 28, 33], [5, 6, 7, 8, 9, 10]]
COMPLETIONS = [[4, 19, 73, 2, 55, 31], [60, 60, 8, 91, 14, 3], [22, 97, 41, 5, 70, 12], [1, 2, 3, 4, 5, 6]]
REFRESH = 3


def scored(model, engine):
    """(trainer, engine) log-probs of COMPLETIONS after PROMPTS, as two [4, 6] tensors."""
    from logra_megatron.rl.grpo import sequence_logprobs
    from logra_megatron.rollout.vllm_engine import rollouts_from_completions

    new = len(COMPLETIONS[0])
    sampling = SamplingConfig(max_new_tokens=new, vocab_size=VOCAB, pad_id=0)
    rollouts = rollouts_from_completions(PROMPTS, COMPLETIONS, [[0.0] * new] * len(PROMPTS), sampling)
    logprobs, _ = sequence_logprobs(model, rollouts, len(PROMPTS), 1.0, VOCAB)
    width = rollouts.prompt_width
    trainer = logprobs[:, width - 1:width - 1 + new]
    engine_rows = engine.prompt_logprobs([p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    ours = torch.tensor([row[len(p) - 1:] for row, p in zip(engine_rows, PROMPTS)])
    return trainer, ours


def train_one_step(ddp, optimizer, seed: int, vocab: int = VOCAB, rows: int = 4, length: int = 24):
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import train_step

    tokens = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, rows, vocab_size=vocab))


def just_refreshed(ddp, optimizer, engine) -> None:
    """Train and sync until the last step refreshed the projections: the next REFRESH - 1
    steps sync in low-rank form."""
    while optimizer.step_count % REFRESH != 1:
        train_one_step(ddp, optimizer, seed=1000 + optimizer.step_count)
        engine.sync_weights(ddp)


@pytest.fixture(scope="module")
def tiny():
    """(model, ddp, optimizer, engine): LoGRA rank 8, refresh every 3 steps, weight decay on, one
    vLLM engine with low-rank sync for the module."""
    from logra_megatron import parallel
    from logra_megatron.rollout.vllm_engine import VLLMEngine
    from logra_megatron.training.setup import build_trainable

    parallel.initialize(1, 1, seed=1234)
    model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=2e-2, weight_decay=0.1),
                                            LogRAConfig(rank=8, refresh_interval=REFRESH), seed=7)
    engine = VLLMEngine(ddp, model_config=MODEL, vocab_size=VOCAB, optimizer=optimizer,
                        policy_sync="lowrank", full_sync_interval=100)
    engine.sync_weights(ddp)  # builds the engine: a full sync
    yield model, ddp, optimizer, engine
    engine.close()


def test_engine_follows_the_trainer_through_low_rank_syncs_across_refreshes(tiny):
    model, ddp, optimizer, engine = tiny
    trainer, ours = scored(model, engine)
    assert torch.allclose(ours, trainer, atol=1e-4, rtol=0)
    kinds, previous = [], trainer
    for step in range(9):
        train_one_step(ddp, optimizer, seed=step)
        measured = engine.sync_weights(ddp)
        kinds.append(int(measured["sync_low_rank"]))
        trainer, ours = scored(model, engine)
        assert torch.allclose(ours, trainer, atol=1e-4, rtol=0), (step, float((ours - trainer).abs().max()))
        assert float((trainer - previous).abs().max()) > 1e-3  # the step moved the policy
        previous = trainer
    # Steps 0, 3 and 6 refresh the projections (full syncs); the other six replay low-rank steps.
    assert kinds == [0, 1, 1, 0, 1, 1, 0, 1, 1], kinds
    assert optimizer.refreshes_done >= 3


def test_low_rank_sync_bytes_are_at_most_three_tenths_of_a_full_sync(tiny):
    model, ddp, optimizer, engine = tiny
    train_one_step(ddp, optimizer, seed=100)
    full = engine.sync_weights(ddp, force_full=True)
    train_one_step(ddp, optimizer, seed=101)
    low = engine.sync_weights(ddp)
    assert (full["sync_low_rank"], low["sync_low_rank"]) == (0.0, 1.0)
    # A full sync sends every weight in fp32 (the output layer apart from the embedding) and,
    # for the low-rank syncs to come, the projections.
    weights = 4 * MODEL.with_changes(vocab=VOCAB).num_parameters()
    projection_bytes = 4 * sum(entry.sketch.projection.numel() for entry in optimizer.weights)
    assert full["sync_bytes"] == weights + projection_bytes
    # One step's U per sketched weight, the dense remainder (embedding, output layer, norms) and
    # the step's two scalars: measured, then checked against the shapes.
    u_bytes = 4 * sum(entry.numel for entry in optimizer.weights)
    dense = [p for p in model.parameters() if id(p) not in {id(e.weight) for e in optimizer.weights}]
    dense_bytes = 4 * sum(p.numel() for p in dense) - 4 * 2 * (MODEL.padded_vocab(1) - VOCAB) * 64
    assert low["sync_bytes"] == u_bytes + dense_bytes + 16
    assert low["sync_bytes"] <= 0.3 * weights, low["sync_bytes"] / weights
    assert low["sync_full_bytes"] == full["sync_bytes"]


def test_k_low_rank_syncs_equal_one_full_sync_of_the_same_weights(tiny):
    model, ddp, optimizer, engine = tiny
    just_refreshed(ddp, optimizer, engine)
    kinds = []
    for step in range(REFRESH - 1):
        train_one_step(ddp, optimizer, seed=210 + step)
        kinds.append(engine.sync_weights(ddp)["sync_low_rank"])
    assert kinds == [1.0] * (REFRESH - 1)
    _, after_low_rank = scored(model, engine)
    engine.sync_weights(ddp, force_full=True)
    trainer, after_full = scored(model, engine)
    assert torch.allclose(after_low_rank, after_full, atol=1e-5, rtol=0), \
        float((after_low_rank - after_full).abs().max())
    assert float(trainer.abs().sum()) > 1.0


def test_an_engine_that_fails_mid_sync_is_rebuilt_with_a_full_sync(tiny):
    model, ddp, optimizer, engine = tiny
    just_refreshed(ddp, optimizer, engine)
    failing = engine.llm
    calls = failing.collective_rpc

    def broken(method, *args, **kwargs):
        if method == "logra_apply":
            raise RuntimeError("the engine died while applying the update")
        return calls(method, *args, **kwargs)

    failing.collective_rpc = broken
    restarts = engine.restarts
    train_one_step(ddp, optimizer, seed=301)
    measured = engine.sync_weights(ddp)
    assert engine.llm is not failing and measured["sync_low_rank"] == 0.0
    assert measured["sync_restarts"] == restarts + 1
    trainer, ours = scored(model, engine)
    assert torch.allclose(ours, trainer, atol=1e-4, rtol=0)
    train_one_step(ddp, optimizer, seed=302)  # the next step is low-rank again, into the new engine
    assert engine.sync_weights(ddp)["sync_low_rank"] == 1.0
    trainer, ours = scored(model, engine)
    assert torch.allclose(ours, trainer, atol=1e-4, rtol=0)


def test_smollm2_low_rank_sync_with_sketched_embeddings_is_at_most_fifteen_hundredths():
    """SmolLM2-135M's shapes (random weights), rank 64, sketched embeddings (tied): between
    refreshes only the factors travel. Sequences of 16 tokens keep the steps cheap."""
    from megatron.core import parallel_state

    from logra_megatron import parallel
    from logra_megatron.rollout.vllm_engine import VLLMEngine
    from logra_megatron.training.setup import build_trainable

    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(1, 1, seed=1234)
    smol = get_preset("smollm2-135m").with_changes(max_seq=64)
    model, ddp, optimizer = build_trainable(smol, OptimizerSettings(kind="logra", lr=1e-3),
                                            LogRAConfig(rank=64, refresh_interval=100, embeddings=True), seed=3)
    engine = VLLMEngine(ddp, model_config=smol, vocab_size=smol.vocab, optimizer=optimizer,
                        policy_sync="lowrank", kv_cache_mb=16, max_num_seqs=8)
    try:
        train_one_step(ddp, optimizer, seed=0, vocab=smol.vocab, rows=2, length=16)  # a refresh step
        full = engine.sync_weights(ddp)
        train_one_step(ddp, optimizer, seed=1, vocab=smol.vocab, rows=2, length=16)
        low = engine.sync_weights(ddp)
        assert (full["sync_low_rank"], low["sync_low_rank"]) == (0.0, 1.0)
        weights = 4 * (smol.num_parameters() + smol.vocab * smol.hidden)  # the output layer travels too
        assert full["sync_bytes"] > weights
        assert low["sync_bytes"] <= 0.15 * weights, low["sync_bytes"] / weights
        sequences = [[1, 500, 9000, 42, 7, 300, 12000, 5], [40000, 3, 3, 77, 1024, 8, 2, 6]]
        from logra_megatron.rl.grpo import sequence_logprobs
        from logra_megatron.rollout.vllm_engine import rollouts_from_completions

        rollouts = rollouts_from_completions([s[:2] for s in sequences], [s[2:] for s in sequences],
                                             [[0.0] * 6] * 2, SamplingConfig(max_new_tokens=6, vocab_size=smol.vocab))
        trainer = sequence_logprobs(model, rollouts, 2, 1.0, smol.vocab)[0][:, 1:]
        ours = torch.tensor([row[1:] for row in engine.prompt_logprobs(sequences)])
        assert torch.allclose(ours, trainer, atol=1e-4, rtol=0), float((ours - trainer).abs().max())
    finally:
        engine.close()
