"""GRPO's loss is the global mean over data-parallel replicas: a batch split over DP=2 gives the
same loss and reduced gradients as the whole batch on every replica, for each aggregation mode
(one 2-rank launch; see tests/workers/grpo_checks.py)."""

import pytest
from dist_harness import result, run_workers


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("grpo_checks.py", 2, tmp_path_factory.mktemp("grpo_checks"))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_split_over_replicas_equals_the_whole_batch(results, mode):
    for rank in (0, 1):
        values = result(results, mode, rank)
        assert values["dp"] == 2
        assert values["grad_scale"] > 0 and abs(values["loss"]) > 0, values  # not trivially equal
        assert values["loss_diff"] < 1e-6 * max(1.0, abs(values["loss"])), values
        assert values["grad_diff"] < 1e-5 * values["grad_scale"], values
