"""Rollouts (logra_megatron.rollout: types, sampling, the Megatron engine).

Multi-rank checks run once under torchrun (tests/workers/rollout_checks.py: 2 ranks, layouts
TP=1, TP=2, PP=2 from the same full weights); the sampling filters and config validation are
tested in-process.
"""

import pytest
import torch

from dist_harness import result, run_workers
from logra_megatron.errors import UserError
from logra_megatron.models.positions import padded_causal_mask
from logra_megatron.rollout.engine import ROLLOUT_ENGINES, RolloutEngine, build_rollout_engine
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.rollout.sampling import sample_next, top_k_filter, top_p_filter

LAYOUTS = ("tp1", "tp2", "pp2")
RANKS = (0, 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("rollout_checks.py", 2, tmp_path_factory.mktemp("rollout"))


# --- greedy decoding with the KV cache vs a no-cache reference ------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", RANKS)
def test_cached_greedy_equals_full_forward_reference(results, layout, rank):
    reference = result(results, f"{layout}/reference", rank)
    assert result(results, f"{layout}/greedy_batch", rank) == reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", RANKS)
def test_padded_prompts_continue_like_each_prompt_alone(results, layout, rank):
    alone = result(results, f"{layout}/greedy_alone", rank)
    assert result(results, f"{layout}/greedy_batch", rank) == alone


def test_greedy_identical_across_layouts(results):
    tp1 = result(results, "tp1/greedy_batch")
    for layout in LAYOUTS:
        for rank in RANKS:
            assert result(results, f"{layout}/greedy_batch", rank) == tp1, (layout, rank)
            assert result(results, f"{layout}/reference", rank) == tp1, (layout, rank)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", RANKS)
def test_packed_prefill_matches_the_padded_one_and_computes_no_padding(results, layout, rank):
    check = result(results, f"{layout}/packed_vs_padded", rank)
    if check["logits_diff"] is not None:  # the last pipeline stage
        assert check["logits_diff"] < 1e-5
    assert check["cache_diff"] < 1e-5 and check["layers"] >= 1
    assert check["packed_tokens"] == [check["real_tokens"]] * check["layers"]  # each prompt once, no padding
    assert check["padded_tokens"] == [check["padded_cells"]] * check["layers"]
    assert check["greedy"][0] == check["greedy"][1]
    assert check["sampled"][0] == check["sampled"][1]


# --- sampling ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ("tp2", "pp2"))
def test_sampled_tokens_agree_on_every_rank_of_a_replica(results, layout):
    assert result(results, f"{layout}/sampled", 0) == result(results, f"{layout}/sampled", 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampling_with_a_seed_is_reproducible(results, layout):
    first = result(results, f"{layout}/sampled")
    assert result(results, f"{layout}/sampled_again") == first
    assert len(first) == 8  # 4 prompts x G=2


def test_sampling_stream_does_not_depend_on_layout(results):
    tp1 = result(results, "tp1/sampled")
    assert result(results, "tp2/sampled") == tp1
    assert result(results, "pp2/sampled") == tp1


def test_same_seed_same_samples_other_seed_other_samples(results):
    seeds = result(results, "seeds")
    assert seeds["a"] == seeds["b"]
    assert seeds["a"] != seeds["c"]


def test_top_k_one_is_greedy(results):
    check = result(results, "top_k_one")
    assert check["top_k_1"] == check["greedy"]


# --- stopping, shapes, masks ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_eos_stops_a_sequence_and_ends_its_response_mask(results, layout):
    check = result(results, f"{layout}/eos")
    assert check["completions"] == check["expected"]
    assert check["completions"][0][-1] == check["expected"][0][-1]  # EOS is part of the completion
    assert check["finished"] == check["expected_finished"]
    assert check["mask_ok"] and check["padded_ok"]
    # A batch whose only row stops early ends the loop early.
    assert check["alone_steps"] == len(check["alone_completion"]) == len(check["expected"][0])
    assert check["alone_shape"] == [1, 3 + 8]  # P + max_new_tokens regardless of early stop


def test_max_new_tokens_respected(results):
    check = result(results, "max_new_tokens")
    assert check["lengths"] == [5, 5, 5, 5]
    assert check["steps"] == 5
    assert check["shape"] == [4, 12 + 5]
    assert check["finished"] == [False] * 4


def test_samples_per_prompt_gives_g_rows(results):
    check = result(results, "rows_per_prompt")
    assert check["num_sequences"] == 12
    assert check["prompt_index"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert check["prompts_ok"]
    assert check["shape"] == [12, 12 + 4]
    assert check["attention_ok"]


def test_positions_start_at_each_prompt_and_training_mode_is_restored(results):
    check = result(results, "positions_and_training_mode")
    assert check["still_training"]
    # Row 0: a 3-token prompt left-padded to 9 columns, then 2 completion tokens.
    assert check["positions_row0"] == [0] * 6 + [0, 1, 2, 3, 4]


def test_bad_prompts_are_user_errors(results):
    messages = result(results, "bad_prompts")
    assert "at least one prompt" in messages["no prompts"]
    assert "prompt 1 is empty" in messages["empty prompt"]
    assert "token id 300 outside the model's vocabulary [0, 256)" in messages["token out of range"]
    assert "exceeds the model's max sequence length 256" in messages["too long"]


def test_full_forward_recompute_over_rollouts_matches_generation(results):
    check = result(results, "teacher_forced_recompute")
    assert check["predicted_ok"]
    assert check["shim_vs_slots_max_diff"] < 1e-4


@pytest.mark.parametrize("rank", RANKS)
def test_data_parallel_replicas_generate_independently(results, rank):
    check = result(results, "dp_independent", rank)
    assert check["completions"] == check["expected"]


# --- in-process: filters and config ---------------------------------------------------------

def _logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_top_p_filter_keeps_the_nucleus():
    # Shuffled on purpose: the filter must map its sorted decision back to vocabulary order.
    probs = [0.15, 0.05, 0.5, 0.1, 0.2]  # sorted: 0.5 (2), 0.2 (4), 0.15 (0), 0.1 (3), 0.05 (1)
    logits = _logits(probs)[None]

    def kept(p):
        return torch.isfinite(top_p_filter(logits, p))[0].nonzero().flatten().tolist()

    assert kept(0.3) == [2]  # the top token alone already reaches 0.3
    assert kept(0.6) == [2, 4]  # 0.5 < 0.6, 0.5 + 0.2 >= 0.6
    assert kept(0.8) == [0, 2, 4]  # 0.85 >= 0.8
    assert kept(0.9) == [0, 2, 3, 4]
    assert kept(1.0) == [0, 1, 2, 3, 4]
    assert kept(1e-6) == [2]  # never empty
    filtered = top_p_filter(logits, 0.6)
    assert torch.equal(filtered[0, [2, 4]], logits[0, [2, 4]])  # kept logits untouched


def test_top_p_sampling_frequencies_follow_the_renormalized_nucleus():
    logits = _logits([0.15, 0.05, 0.5, 0.1, 0.2])[None].expand(20000, -1)
    generator = torch.Generator().manual_seed(0)
    draws = sample_next(logits, temperature=1.0, top_p=0.8, generator=generator)
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    expected = torch.tensor([0.15, 0.0, 0.5, 0.0, 0.2], dtype=torch.float64) / 0.85
    assert torch.allclose(freq, expected, atol=0.015), freq


def test_top_k_filter_and_greedy():
    logits = _logits([0.15, 0.05, 0.5, 0.1, 0.2])[None]
    assert torch.isfinite(top_k_filter(logits, 2))[0].nonzero().flatten().tolist() == [2, 4]
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert sample_next(logits, temperature=0.0).tolist() == [2]
    generator = torch.Generator().manual_seed(3)
    many = sample_next(logits.expand(50, -1), temperature=2.0, top_k=1, generator=generator)
    assert many.eq(2).all()


def test_sampling_is_reproducible_with_a_generator():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    a = sample_next(logits, 0.7, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b = sample_next(logits, 0.7, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_padded_causal_mask():
    real = torch.tensor([[False, True, True], [True, True, True]])
    mask = padded_causal_mask(real)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, True, True], [True, False, True], [True, False, False]]
    assert mask[1, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]


@pytest.mark.parametrize("changes, message", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=-0.1), "top_p must be in (0, 1]"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=-3), "max_new_tokens must be >= 1"),
    (dict(samples_per_prompt=0), "samples_per_prompt must be >= 1"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(eos_id=-1), "eos_id must be >= 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(vocab_size=100, eos_id=100), "eos_id 100 is outside the vocabulary of size 100"),
])
def test_bad_sampling_config_is_a_user_error(changes, message):
    with pytest.raises(UserError) as error:
        SamplingConfig(**changes)
    assert message in str(error.value)


def test_good_sampling_config():
    config = SamplingConfig(temperature=0, top_p=1.0, max_new_tokens=1, eos_id=2, vocab_size=3)
    assert config.greedy
    assert not SamplingConfig(temperature=0.7).greedy


# --- the rollout-engine interface ----------------------------------------------------------

def test_engine_registry_builds_engines_that_satisfy_the_interface():
    for name in ROLLOUT_ENGINES:
        engine = build_rollout_engine(name, model=None)
        assert isinstance(engine, RolloutEngine) and engine.name == name
    with pytest.raises(UserError, match="unknown rollout engine 'nope'"):
        build_rollout_engine("nope", model=None)


def test_prompt_layout_masks_padding_on_both_sides():
    """The shared left-padded layout (both engines build their Rollouts with it): left padding and
    the right padding after a short completion are neither attended nor scored."""
    from logra_megatron.rollout.types import PromptLayout

    layout = PromptLayout.of([[5, 6, 7], [8]], samples_per_prompt=2, max_new_tokens=3, pad_id=0)
    assert layout.width == 3 and layout.tokens.shape == (4, 6)
    assert layout.tokens[2].tolist() == [0, 0, 8, 0, 0, 0] and layout.prompt_index.tolist() == [0, 0, 1, 1]
    layout.tokens[:, 3] = 9  # every row generated one token; row 0 two
    layout.tokens[0, 4] = 9
    batch = layout.rollouts(torch.tensor([2, 1, 1, 1]), torch.tensor([False, True, True, True]), steps=2)
    assert batch.attention_mask.int().tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0],
                                                   [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]]
    assert batch.response_mask.int().tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0],
                                                  [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]]
    assert batch.position_ids[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert batch.completions() == [[9, 9], [9], [9], [9]] and batch.prompt(2) == [8]
