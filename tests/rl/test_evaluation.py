"""The evaluation's statistics against closed forms: the unbiased pass@k estimator, Wilson's
interval, and the summary of per-problem outcomes."""

import itertools
import math

import pytest

from logra_megatron.rl.evaluation import k_values, pass_at_k, summarize, wilson_interval


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
