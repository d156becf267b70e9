"""LoGRA at TP=2, PP=2, TP=2xPP=2, DP, ZeRO-1 and across a TP=2 -> TP=1 checkpoint equals the
TP=1 run from the same initial weights (3 steps crossing a projection refresh). One 4-rank
launch for all."""

import pytest
from dist_harness import result, run_workers

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("logra_checks.py", 4, tmp_path_factory.mktemp("logra"))


def test_reference_trains_and_refreshes(results):
    assert result(results, "sketched_weights") == 16  # 4 layers x (qkv, proj, fc1, fc2)
    assert result(results, "reference_moved") > 0.05
    assert result(results, "refreshes_done") == 2


def test_no_dense_gradient_for_sketched_weights(results):
    for rank in range(4):
        flags = result(results, "no_dense_grad_for_sketched_weights", rank)
        assert len(flags) == 16 and all(flags.values()), flags


@pytest.mark.parametrize("check", ["tp2", "pp2", "tp2_pp2"])
def test_same_sketches_and_weights_as_tp1(results, check):
    for rank in range(4):
        value = result(results, check, rank)
        assert value["sketch_rel_err"] < TOLERANCE, value
        assert value["weight_rel_err"] < TOLERANCE, value
        assert value["refreshes_done"] == 2


@pytest.mark.parametrize("check", ["dp4_split_batch", "tp2_dp2_split_batch", "zero1_dp4", "zero1_tp2_dp2"])
def test_data_parallel_and_zero1_match_the_combined_batch(results, check):
    for rank in range(4):
        value = result(results, check, rank)
        assert value["weight_rel_err"] < TOLERANCE, value


def test_checkpoint_at_tp2_resumes_at_tp1_with_the_same_next_update(results):
    for rank in range(4):
        assert result(results, "ckpt_save_tp2", rank) is True
        value = result(results, "ckpt_resume_tp1", rank)
        assert value["resumed_step"] == 2
        assert value["weight_rel_err"] < TOLERANCE, value
