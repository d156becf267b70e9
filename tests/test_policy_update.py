"""The low-rank policy update without vLLM: the optimizer's commit log
(logra_megatron/logra/commit_log.py), the message built from it and its replay
(logra_megatron/rollout/policy_update.py) at TP=1, TP=2 and PP=2 (tests/workers/policy_update_checks.py,
2 ranks), and the command-line checks of ``--policy-sync``. The engine side, with vLLM, is
tests/test_vllm_policy_sync.py.
"""

import importlib.util

import pytest
import torch

from dist_harness import result, run_workers
from logra_megatron.errors import UserError
from logra_megatron.logra.commit_log import Commit, CommitLog

LAYOUTS = ("tp1", "tp2", "pp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("policy_update_checks.py", 2, tmp_path_factory.mktemp("policy_update"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replaying_the_message_onto_the_old_weights_gives_the_new_ones(results, layout):
    found = result(results, layout, 0)
    assert found["engine_rank"] and found["commits"] == 3 and found["replayable"]
    assert found["moved"] > 1e-2  # three steps changed the weights
    assert found["max_diff"] <= 1e-6, found["max_diff"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_factors_and_dense_tensors_cover_every_weight_once(results, layout):
    found = result(results, layout, 0)
    factors, dense, names = set(found["factors"]), set(found["dense"]), set(found["hf_names"])
    assert not factors & dense
    assert factors | dense == names
    # Sketched embeddings (tp2, pp2) travel as factors; otherwise as dense tensors.
    embedding = "model.embed_tokens.weight"
    assert (embedding in factors) == (layout != "tp1")
    assert all(name.endswith("norm.weight") for name in dense - {embedding, "lm_head.weight"})


def test_the_message_is_built_on_the_replicas_first_rank_only(results):
    assert result(results, "tp1", 1)["engine_rank"]  # TP=1 on 2 ranks: two replicas
    for layout in ("tp2", "pp2"):
        other = result(results, layout, 1)
        assert not other["engine_rank"] and other["commits"] == 3


# --- the commit log --------------------------------------------------------------------------

def commit(refresh=False):
    return Commit(torch.zeros(3), 0.1, 0.0, refresh)


def test_commit_log_hands_over_commits_once():
    log = CommitLog(limit=4)
    log.record(commit())
    log.record(commit())
    assert len(log.take()) == 2
    assert log.take() == []


def test_commit_log_past_its_limit_or_invalidated_asks_for_a_full_sync():
    log = CommitLog(limit=2)
    for _ in range(3):
        log.record(commit())
    assert log.take() is None
    log.record(commit())
    assert len(log.take()) == 1  # a take starts afresh
    log.record(commit())
    log.invalidate()
    log.record(commit())
    assert log.take() is None


def test_replayable_refuses_refreshed_projections_and_missing_commits():
    from logra_megatron.rollout.policy_update import replayable

    class Optimizer:
        redraws_projections = False

    assert replayable([commit(), commit()], Optimizer()) == (True, "")
    assert not replayable([commit(), commit(refresh=True)], Optimizer())[0]
    assert not replayable(None, Optimizer())[0]
    Optimizer.redraws_projections = True
    assert not replayable([commit()], Optimizer())[0]


# --- flags -----------------------------------------------------------------------------------

def parse(argv):
    from logra_megatron.config import parse_train_args

    return parse_train_args(argv, world_size=1)


def test_policy_sync_lowrank_needs_the_vllm_engine_and_logra():
    with pytest.raises(UserError, match="--policy-sync lowrank .* needs --rollout-engine vllm"):
        parse(["--policy-sync", "lowrank"])
    with pytest.raises(UserError, match="--full-sync-interval must be >= 1"):
        parse(["--full-sync-interval", "0"])
    if importlib.util.find_spec("vllm") is not None:  # (without vLLM the engine's own check comes first)
        with pytest.raises(UserError, match="needs --optimizer logra, got adam"):
            parse(["--rollout-engine", "vllm", "--policy-sync", "lowrank", "--optimizer", "adam"])


def test_num_attention_heads_changes_the_preset():
    model = parse(["--num-attention-heads", "2"]).model_config
    assert (model.heads, model.kv_heads, model.kv_channels) == (2, 2, 32)
    model = parse(["--num-attention-heads", "2", "--num-query-groups", "1"]).model_config
    assert (model.heads, model.kv_heads) == (2, 1)
    with pytest.raises(UserError, match="--num-attention-heads 3 must divide the hidden size 64"):
        parse(["--num-attention-heads", "3"])
    with pytest.raises(UserError, match="must be a multiple of --num-query-groups 4"):
        parse(["--num-attention-heads", "2", "--num-query-groups", "4"])
