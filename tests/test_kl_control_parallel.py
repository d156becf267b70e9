"""The KL controller's scale is agreed on every rank (TP=2, PP=2, DP) and DP replicas stay
bitwise identical; the copy-free forecast equals the exact one (weights copied) at TP=1, TP=2
and PP=2. One 4-rank launch."""

import pytest
from dist_harness import result, run_workers


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("kl_checks.py", 4, tmp_path_factory.mktemp("kl"))


@pytest.mark.parametrize("mode", ["probe", "linear"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)])
def test_same_scale_everywhere_and_identical_replicas(results, mode, tp, pp):
    for rank in range(4):
        value = result(results, f"{mode}_tp{tp}_pp{pp}", rank)
        assert value["all_ranks_agree"], value
        assert value["dp_replicas_identical"], value
        assert value["dp_size"] == 4 // (tp * pp)
        # The learning rate is large enough that the controller actually shrinks the step.
        assert min(value["scales"]) < 1.0, value


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_copy_free_forecast_equals_the_exact_probe(results, tp, pp):
    for rank in range(4):
        value = result(results, f"copy_free_tp{tp}_pp{pp}", rank)
        assert value["exact"] > 1e-4, value  # a real step, not a trivially equal zero
        assert value["rel_diff"] < 1e-5, value
