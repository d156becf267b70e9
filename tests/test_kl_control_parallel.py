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


@pytest.mark.parametrize("virtual", [1, 2], ids=["pp2", "pp2_vpp2"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_probe_goes_through_the_pipeline_in_one_schedule_call(results, virtual, layout):
    """Under PP=2 (and its interleaved schedule) a forecast's forward pass takes all the probe's
    parts through ONE call of Megatron's schedule (two calls: s = 0 and s), and forecasts what one
    call per part does (the controller before), bitwise in probe mode; the packed parts, of
    different real lengths, are filled to one length for it."""
    for rank in range(4):
        value = result(results, f"probe_through_pipeline_vpp{virtual}", rank)[layout]
        assert value["parts"] >= 3, value
        if layout == "packed":
            assert len(value["packed_real_lengths"]) > 1, value  # the parts differ before filling
        assert value["reference_schedule_calls"] == value["parts"], value  # one per part
        assert value["forecast_schedule_calls"] == 2, value
        assert value["linear_schedule_calls"] == 2, value
        assert value["reference"] > 1e-4, value
        assert value["forecast"] == value["reference"], value
        assert value["linear"] == pytest.approx(value["linear_reference"], rel=1e-9), value
