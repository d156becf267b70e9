"""Low-rank policy updates on 2 ranks (logra_megatron/rollout/policy_update.py), without vLLM:
at TP=1 (two replicas), TP=2 and PP=2 (tied, sketched embeddings: the last stage holds a pipeline
copy), the HF weights before some LoGRA steps, replayed with the message built from the
optimizer's commit log, must equal the HF weights after them. tests/test_policy_update.py asserts.
"""

import torch

from common import Checks

from logra_megatron import parallel
from logra_megatron.convert.hf import megatron_to_hf
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.models.weights import full_state
from logra_megatron.rollout.policy_update import low_rank_message, projections, replay, replayable, routes
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable, train_step

TINY = get_preset("tiny")
STEPS = 3


def hf_state(model, config):
    return {name: tensor.float().clone() for name, tensor in megatron_to_hf(full_state(model), config).items()}


def replay_check(model_config, logra_config):
    model, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind="logra", lr=2e-2, weight_decay=0.1),
                                            logra_config, seed=11)
    batch = lambda step: torch.randint(0, model_config.vocab, (4, 16), generator=torch.Generator().manual_seed(step))
    train_step(ddp, optimizer, lambda m: lm_forward_backward(m, batch(0), 4, vocab_size=model_config.vocab))
    optimizer.log_commits(limit=8)  # after the first (refresh) step, as after a full sync
    before = hf_state(model, model_config)
    found = routes(optimizer, model_config, untied_output=False)
    held = projections(optimizer, torch.float32)
    for step in range(1, 1 + STEPS):
        train_step(ddp, optimizer, lambda m: lm_forward_backward(m, batch(step), 4, vocab_size=model_config.vocab))
    commits = optimizer.commit_log.take()
    can, why = replayable(commits, optimizer)
    message = low_rank_message(ddp, optimizer, commits, model_config, torch.float32)
    after = hf_state(model, model_config)
    if message is None:  # not the engine's rank
        return {"engine_rank": False, "commits": len(commits), "replayable": can}
    moved = max(float((after[n] - before[n]).abs().max()) for n in after)
    replay(before, held, found, message)
    return {
        "engine_rank": True, "commits": len(commits), "replayable": can, "why": why,
        "max_diff": max(float((after[n] - before[n]).abs().max()) for n in after),
        "moved": moved,
        "factors": sorted(message.steps[0].factors),
        "dense": sorted(message.dense),
        "hf_names": sorted(after),
        "bytes": message.nbytes(),
    }


def main():
    checks = Checks()
    untied = LogRAConfig(rank=8, refresh_interval=100)
    tied = TINY.with_changes(tie_embeddings=True)
    sketched = LogRAConfig(rank=8, refresh_interval=100, embeddings=True)
    for tag, (tp, pp), model_config, logra_config in (
            ("tp1", (1, 1), TINY, untied),
            ("tp2", (2, 1), TINY, sketched),
            ("pp2", (1, 2), tied, sketched)):
        parallel.initialize(tp, pp, seed=1234)
        checks.run(tag, replay_check, model_config, logra_config)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
