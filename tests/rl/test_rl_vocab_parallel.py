"""Vocab-parallel log-probs, entropy and KL at TP=2 equal the full-vocabulary values and
gradients (one 2-rank launch; see tests/workers/rl_vocab_parallel.py)."""

import pytest
from dist_harness import result, run_workers

RANKS = (0, 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("rl_vocab_parallel.py", 2, tmp_path_factory.mktemp("rl_vocab_parallel"))


def test_worker_really_split_the_vocabulary(results):
    for rank in RANKS:
        assert result(results, "layout", rank) == {"tp": 2, "local_vocab": 6}


@pytest.mark.parametrize("check,tolerance", [
    ("float64", 1e-12), ("temperature", 1e-12), ("float32", 1e-5),
])
def test_values_and_gradients_match_full_log_softmax(results, check, tolerance):
    for rank in RANKS:
        values = result(results, check, rank)
        assert values["logprob"] < tolerance, values
        assert values["entropy"] < tolerance, values
        assert values["grad"] < tolerance * values["grad_scale"], values


def test_bfloat16_logits_are_computed_in_float32_and_grad_keeps_their_dtype(results):
    for rank in RANKS:
        values = result(results, "bfloat16", rank)
        assert values["logprob"] < 1e-5 and values["entropy"] < 1e-5, values
        assert values["grad_dtype"] == "torch.bfloat16"
        # Only the final rounding of the gradient to bfloat16 (8 significant bits) differs.
        assert values["grad"] < 2 ** -7 * values["grad_scale"], values


def test_logprob_only_gradient(results):
    for rank in RANKS:
        assert result(results, "logprob_only_gradient", rank)["grad"] < 1e-12


def test_logprob_equals_minus_megatron_cross_entropy(results):
    for rank in RANKS:
        assert result(results, "megatron_cross_entropy", rank)["diff"] < 1e-6


def test_masked_vocabulary_entries_are_exact_and_finite(results):
    for rank in RANKS:
        values = result(results, "masked_vocabulary", rank)
        assert values["finite"] is True
        assert max(values["logprob"], values["entropy"], values["grad"]) < 1e-12, values


def test_kl_matches_full_vocabulary(results):
    for rank in RANKS:
        values = result(results, "kl", rank)
        assert values["min_expected"] > 1e-3  # the two distributions really differ
        assert values["diff"] < 1e-12, values
        assert values["self_kl"] < 1e-12, values


def test_the_kl_controllers_sums_in_token_chunks_equal_the_full_vocabulary_sums(results):
    """ops/vocab_parallel.py masked_kl_sum / masked_half_variance_sum at TP2, chunks of two token
    positions (the last one short) and one chunk: the same sums within fp64 rounding."""
    for rank in RANKS:
        values = result(results, "chunked_kl_sums", rank)
        assert values["scale"] > 1e-2, values  # the distributions and the step really differ
        for key in ("kl_chunked", "kl_whole", "var_chunked", "var_whole"):
            assert values[key] < 1e-12, (key, values)
