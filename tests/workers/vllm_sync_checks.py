"""The vLLM engine fed by a multi-rank trainer (2 ranks, TP=2 then PP=2): the replica's first
rank hosts the engine in processes of its own; the full sync and the low-rank syncs gather over
TP and PP into it. tests/test_vllm_multirank.py asserts.

Per layout: greedy rollouts against the Megatron engine's, seeded sampling, then LoGRA steps
(rank 8, refresh every 3 steps, weight decay on) each followed by a sync, and after every sync
the engine's log-probs of fixed sequences against the trainer's.
"""

import torch

from common import Checks

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.rl.grpo import sequence_logprobs
from logra_megatron.rollout.engine import build_rollout_engine
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.rollout.vllm_engine import VLLMEngine, rollouts_from_completions
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable, train_step

VOCAB = 99
MODEL = get_preset("tiny").with_changes(heads=2, kv_heads=2)  # head dim 32; 2 kv heads split over TP=2
PROMPTS = [[17, 83, 45], [3, 88, 50, 9, 40, 61, 77, 12, 98], [50, 1, 64, 28, 33], [5, 6, 7, 8, 9, 10]]
COMPLETIONS = [[4, 19, 73, 2, 55, 31], [60, 60, 8, 91, 14, 3], [22, 97, 41, 5, 70, 12], [1, 2, 3, 4, 5, 6]]
STEPS = 8


def scored(model, engine):
    """Largest |engine - trainer| log-prob over COMPLETIONS, and the trainer's log-probs."""
    new = len(COMPLETIONS[0])
    rollouts = rollouts_from_completions(PROMPTS, COMPLETIONS, [[0.0] * new] * len(PROMPTS),
                                         SamplingConfig(max_new_tokens=new, vocab_size=VOCAB))
    logprobs, _ = sequence_logprobs(model, rollouts, len(PROMPTS), 1.0, VOCAB)
    width = rollouts.prompt_width
    trainer = logprobs[:, width - 1:width - 1 + new]
    rows = engine.prompt_logprobs([p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    ours = torch.tensor([row[len(p) - 1:] for row, p in zip(rows, PROMPTS)])
    return float((ours - trainer).abs().max()), trainer


def layout_check(tp: int, pp: int):
    parallel.initialize(tp, pp, seed=1234)
    model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=2e-2, weight_decay=0.1),
                                            LogRAConfig(rank=8, refresh_interval=3), seed=7)
    engine = VLLMEngine(ddp, model_config=MODEL, vocab_size=VOCAB, optimizer=optimizer, policy_sync="lowrank",
                        full_sync_interval=100, kv_cache_mb=32, max_num_seqs=16)
    try:
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=8, vocab_size=VOCAB)
        ours = engine.generate(PROMPTS, greedy).completions()
        theirs = build_rollout_engine("megatron", ddp).generate(PROMPTS, greedy).completions()
        first = engine.last_sync
        sampled = [engine.generate(PROMPTS, SamplingConfig(max_new_tokens=8, samples_per_prompt=2, seed=seed,
                                                           vocab_size=VOCAB)).completions()
                   for seed in (5, 5, 6)]
        diff, previous = scored(model, engine)
        diffs, kinds, moved = [diff], [], []
        for step in range(STEPS):
            tokens = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(step))
            train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, 4, vocab_size=VOCAB))
            kinds.append(int(engine.sync_weights(ddp)["sync_low_rank"]))
            diff, trainer = scored(model, engine)
            diffs.append(diff)
            moved.append(float((trainer - previous).abs().max()))
            previous = trainer
        return {"greedy_vllm": ours, "greedy_megatron": theirs, "diffs": diffs, "kinds": kinds, "moved": moved,
                "full_bytes": first["sync_bytes"],
                "sampled": sampled, "separate_process": engine.separate_process}
    finally:
        engine.close()


def main():
    checks = Checks()
    checks.run("tp2", layout_check, 2, 1)
    checks.run("pp2", layout_check, 1, 2)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
