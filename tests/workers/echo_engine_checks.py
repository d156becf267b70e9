"""The echo engine (tests/plugins/echo_engine.py, a RemoteEngine outside the package) fed by a
trainer on 2 ranks (TP=2): chosen through the registry by ``module:attr``, its worker in a
process of its own on the replica's first rank. tests/test_remote_engine.py asserts.

After each sync the engine's rank records what its worker holds (the sum of every tensor by
Hugging Face name) beside the trainer's weights converted to those names; every rank records
the rows ``generate`` gave it.
"""

import sys
from pathlib import Path

import torch

from common import Checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # echo_engine, echo_worker

from logra_megatron import parallel  # noqa: E402
from logra_megatron.convert.hf import megatron_to_hf  # noqa: E402
from logra_megatron.logra.config import LogRAConfig  # noqa: E402
from logra_megatron.models import get_preset  # noqa: E402
from logra_megatron.models.weights import full_state  # noqa: E402
from logra_megatron.rollout.engine import build_rollout_engine  # noqa: E402
from logra_megatron.parallel import is_replica_lead  # noqa: E402
from logra_megatron.rollout.types import SamplingConfig  # noqa: E402
from logra_megatron.training.config import OptimizerSettings  # noqa: E402
from logra_megatron.training.lm import lm_forward_backward  # noqa: E402
from logra_megatron.training.setup import build_trainable, train_step  # noqa: E402

VOCAB = 99
MODEL = get_preset("tiny").with_changes(heads=2, kv_heads=2)  # 2 kv heads split over TP=2
PROMPTS = [[17, 83, 45], [3, 88, 50, 9, 40, 61, 77, 12, 98], [50, 1, 64, 28, 33]]
SAMPLING = SamplingConfig(max_new_tokens=6, samples_per_prompt=2, vocab_size=VOCAB)


def delivered(model, engine):
    """On the engine's rank: (the names the worker holds == the trainer's HF names, the largest
    |worker - trainer| tensor sum, relative to that sum); None elsewhere. Collective over TP."""
    trainer = megatron_to_hf(full_state(model), MODEL.with_changes(vocab=VOCAB))
    if not is_replica_lead():
        return None
    seen = engine._rpc("echo_checksums")
    sums = {name: float(tensor.double().sum()) for name, tensor in trainer.items()}
    gap = max(abs(seen[name] - total) / max(abs(total), 1.0) for name, total in sums.items() if name in seen)
    return {"same_names": sorted(seen) == sorted(sums), "gap": gap, "count": len(seen)}


def echo_check():
    parallel.initialize(2, 1, seed=1234)
    model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=2e-2, weight_decay=0.1),
                                            LogRAConfig(rank=8, refresh_interval=100), seed=7)
    engine = build_rollout_engine("echo_engine:EchoEngine", ddp, model_config=MODEL, vocab_size=VOCAB,
                                  optimizer=optimizer, policy_sync="lowrank", sync_bucket_mb=1)
    try:
        found = {"class": type(engine).__name__, "separate_process": engine.separate_process}
        found["rows_before"] = engine.generate(PROMPTS, SAMPLING).completions()  # the first full sync
        found["full"] = delivered(model, engine)
        found["full_bytes"] = engine.last_sync["sync_bytes"]
        kinds = []
        for step in range(2):  # the first step draws the projections (a full sync), the second not
            tokens = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(step))
            train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, 4, vocab_size=VOCAB))
            kinds.append(engine.sync_weights(ddp)["sync_low_rank"])
        found["kinds"] = kinds
        found["after_low_rank"] = delivered(model, engine)
        found["rows_after"] = engine.generate(PROMPTS, SAMPLING).completions()
        return found
    finally:
        engine.close()


def main():
    checks = Checks()
    checks.run("echo", echo_check)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
