"""The vLLM engine fed by a trainer on 2 ranks (TP=2, then PP=2): the engine runs in processes of
its own on the replica's first rank, the full sync and the low-rank syncs gather over TP and PP
into it (logra_megatron/rollout/vllm_engine.py, policy_update.py). The checks run in
tests/workers/vllm_sync_checks.py; one launch serves the module.
"""

import importlib.util

import pytest

from dist_harness import result, run_workers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[rollout]')")

LAYOUTS = ("tp2", "pp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("vllm_sync_checks.py", 2, tmp_path_factory.mktemp("vllm_multirank"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_rollouts_match_the_megatron_engine(results, layout):
    found = result(results, layout, 0)
    assert found["separate_process"]
    assert found["greedy_vllm"] == found["greedy_megatron"]
    assert all(len(completion) > 0 for completion in found["greedy_vllm"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seeds_reach_the_engine_process(results, layout):
    same, again, other = result(results, layout, 0)["sampled"]
    assert same == again  # the seed is set where the sampler draws
    assert same != other


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_follows_the_trainer_through_low_rank_syncs(results, layout):
    found = result(results, layout, 0)
    # Refresh every 3 steps: the steps that drew new projections sync in full, the rest low rank.
    assert found["kinds"] == [0, 1, 1, 0, 1, 1, 0, 1], found["kinds"]  # 5 low-rank syncs
    assert found["full_bytes"] > 0
    assert min(found["moved"]) > 1e-2  # every step changed the trainer's log-probs
    assert max(found["diffs"]) <= 1e-4, found["diffs"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_ranks_see_the_same_syncs(results, layout):
    first, second = result(results, layout, 0), result(results, layout, 1)
    assert first["kinds"] == second["kinds"]
    assert first["greedy_vllm"] == second["greedy_vllm"]
