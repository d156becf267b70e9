"""The evaluation's statistics against closed forms: the unbiased pass@k estimator, Wilson's
interval, and the summary of per-problem outcomes."""

import itertools
import math

import pytest

from logra_megatron.rl.evaluation import evaluate_records, k_values, pass_at_k, summarize, wilson_interval


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 4), (8, 7, 2), (5, 5, 5), (20, 1, 10), (4, 2, 4)])
def test_pass_at_k_equals_the_binomial_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_correct_sample():
    samples = [1, 0, 0, 1, 0, 0]  # 2 of 6 right
    for k in range(1, 7):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_1_is_the_fraction_correct_and_bad_k_is_refused():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_wilson_interval_matches_its_formula_and_stays_in_the_unit_interval():
    z = 1.959963984540054
    p, n = 0.3, 50
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(p, n) == pytest.approx((centre - half, centre + half))
    low, high = wilson_interval(0.0, 20)
    assert low == 0.0 and 0.1 < high < 0.2  # not an empty interval at 0%
    assert wilson_interval(1.0, 20)[1] == pytest.approx(1.0)


def test_summary_of_outcomes():
    result = summarize([True, False, False, True], sampled_correct=[4, 0, 1, 2], samples=4, temperature=0.7)
    assert result.problems == 4 and result.greedy_pass_at_1 == 0.5
    assert sorted(result.pass_at_k) == k_values(4) == [1, 2, 4]
    assert result.pass_at_k[1] == pytest.approx((1 + 0 + 0.25 + 0.5) / 4)
    assert result.pass_at_k[4] == pytest.approx(3 / 4)
    line = result.summary_line()
    assert "greedy pass@1 50.0%" in line and "pass@4 75.0%" in line and "4 samples at temperature 0.7" in line
    assert set(result.to_dict()) >= {"problems", "greedy_pass_at_1", "greedy_ci95", "pass_at_k", "pass_at_k_ci95"}


# --- the evaluation's model passes: the engine's prefill, packed -------------------------------

class _Bytes:
    """A byte-level tokenizer: token ``b`` is byte ``b`` (no EOS: completions run to the cap)."""

    eos_id = None
    pad_id = 0

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode("latin-1")


class _ParityReward:
    """Full credit when a completion's byte sum is even: depends on every generated token."""

    def score_batch(self, records, texts):
        return [float(sum(text.encode("latin-1")) % 2 == 0) for text in texts]


def test_evaluation_is_identical_packed_and_padded_and_prefills_each_prompt_once():
    """``evaluate_records`` on the Megatron engine, prefill packed and padded: the same figures
    (greedy pass@1 and pass@k of 4 samples); packed, each pass sends every prompt's real tokens
    once through each attention layer (not 4 copies of the padded block)."""
    from logra_megatron import parallel
    from logra_megatron.models import build_gpt_model, get_preset
    from logra_megatron.models.build import unwrap_model
    from logra_megatron.rollout.megatron_engine import MegatronEngine
    from logra_megatron.rollout.types import SamplingConfig

    preset = get_preset("tiny")
    parallel.initialize(1, 1, seed=4321)
    model = build_gpt_model(preset)
    records = ["2+2=", "the capital of a country with a long name is", "x", "abc", "seventeen minus nine"]
    base = SamplingConfig(max_new_tokens=5, vocab_size=preset.vocab)
    layers = [m for name, m in unwrap_model(model).named_modules() if name.endswith("core_attention")]

    class Counted(MegatronEngine):
        """Each generate() call's prefill: the tokens its first attention layer computed first."""

        prefills = []

        def generate(self, prompts, sampling):
            calls = []
            handle = layers[0].register_forward_pre_hook(
                lambda module, args: calls.append(args[0].numel() // (args[0].shape[-1] * args[0].shape[-2])))
            try:
                return super().generate(prompts, sampling)
            finally:
                handle.remove()
                self.prefills.append(calls[0])

    results, prefills = {}, {}
    for pack in (False, True):
        engine = Counted(model, pack_sequences=pack)
        engine.prefills = []
        results[pack] = evaluate_records(engine, _Bytes(), lambda record: record, _ParityReward(), records, base,
                                         samples=4, temperature=1.0, seed=3)
        prefills[pack] = engine.prefills
    assert results[True].to_dict() == results[False].to_dict()
    assert 0 < results[True].pass_at_k[4]  # the reward saw real completions
    real = sum(len(r.encode()) for r in records)
    width = max(len(r.encode()) for r in records)
    assert prefills[True] == [real, real]  # greedy pass, sampled pass: each prompt once, no padding
    assert prefills[False] == [len(records) * width, 4 * len(records) * width]
