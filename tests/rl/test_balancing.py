"""Token balancing over data-parallel replicas (rl/balancing.py).

The pure assignment: every row exactly once, each replica keeps its rows per minibatch part
(so each optimizer step sees the same rows and every replica splits the same), and a skewed
batch comes out balanced. The exchange itself (2 gloo ranks): the rows after it are the rows
before it, each once, and the policy-loss gradient and loss with balancing equal those without
it (tests/workers/balancing_checks.py).
"""

import itertools
import random

import pytest
from dist_harness import result, run_workers

from logra_megatron.rl.balancing import assign_rows, plan_exchange, token_ratio


def loads(lengths, plan):
    return [sum(lengths[row] for row in rows) for rows in plan]


def check_plan(lengths, parts, counts, plan):
    """Every row once; rank r holds counts[r][k] rows of part k, part by part."""
    assert sorted(row for rows in plan for row in rows) == list(range(len(lengths)))
    for rank, rows in enumerate(plan):
        held = [parts[row] for row in rows]
        assert held == sorted(held)  # part by part: split_minibatches cuts the parts back out
        assert [held.count(k) for k in range(len(counts[rank]))] == list(counts[rank])


def test_every_row_once_and_counts_kept():
    rng = random.Random(0)
    for _ in range(50):
        ranks, num_parts = rng.randint(2, 4), rng.randint(1, 3)
        counts = [[rng.randint(1, 5) for _ in range(num_parts)] for _ in range(ranks)]
        parts = [k for k in range(num_parts) for _ in range(sum(c[k] for c in counts))]
        rng.shuffle(parts)
        lengths = [rng.randint(1, 300) for _ in parts]
        check_plan(lengths, parts, counts, assign_rows(lengths, parts, counts))


def test_skewed_batch_is_balanced():
    # As the replicas sampled it: replica 0 all the long rows, replica 1 all the short ones.
    lengths = [400, 390, 380, 370, 20, 15, 12, 10]
    before = [lengths[:4], lengths[4:]]
    counts = [[4], [4]]
    plan = assign_rows(lengths, [0] * 8, counts)
    check_plan(lengths, [0] * 8, counts, plan)
    assert token_ratio([sum(b) for b in before]) > 20
    assert token_ratio(loads(lengths, plan)) < 1.05, plan


def test_long_row_and_many_short_within_one_row_of_the_optimum():
    # One very long row, many short: under equal counts the long row's rank also takes the
    # shortest rows; greedy longest-first is within the longest short row of the best split.
    lengths = [2000] + [30 + 7 * i for i in range(15)]
    counts = [[8], [8]]
    plan = assign_rows(lengths, [0] * 16, counts)
    check_plan(lengths, [0] * 16, counts, plan)
    best = min(max(sum(lengths[i] for i in side), sum(lengths) - sum(lengths[i] for i in side))
               for side in itertools.combinations(range(16), 8))
    assert max(loads(lengths, plan)) <= best + max(lengths[1:]), (plan, best)
    assert 0 in plan[0] and plan[0][1:] == sorted(plan[0][1:])
    # the long row's rank gets the 7 shortest rows
    assert sorted(lengths[i] for i in plan[0] if i) == sorted(lengths[1:])[:7]


def test_small_instances_near_optimal():
    rng = random.Random(1)
    for _ in range(30):
        lengths = [rng.randint(1, 100) for _ in range(8)]
        plan = assign_rows(lengths, [0] * 8, [[4], [4]])
        best = min(max(sum(lengths[i] for i in side), sum(lengths) - sum(lengths[i] for i in side))
                   for side in itertools.combinations(range(8), 4))
        assert max(loads(lengths, plan)) <= best + max(lengths), (lengths, plan, best)


def test_counts_must_match_the_rows():
    with pytest.raises(ValueError):
        assign_rows([5, 5, 5], [0, 0, 0], [[1], [1]])


def test_plan_exchange_moves_rows_only_when_it_helps():
    # Already balanced per minibatch: nothing moves (no exchange, the batch stays as sampled).
    assert plan_exchange([[10, 20, 30, 40], [20, 10, 40, 30]], 2) is None
    # Skewed: a plan, every (rank, row) once, each rank keeping 2 rows of each of its 2 minibatches.
    lengths = [[400, 390, 380, 370], [20, 15, 12, 10]]
    plan = plan_exchange(lengths, 2)
    assert plan is not None
    assert sorted(source for mine in plan for source in mine) == [(r, i) for r in (0, 1) for i in range(4)]
    for mine in plan:
        assert [i // 2 for _, i in mine] == [0, 0, 1, 1]  # source minibatch of each row, in order
    after = [sum(lengths[r][i] for r, i in mine) for mine in plan]
    assert token_ratio(after) < 1.1 < token_ratio([sum(rows) for rows in lengths]), after


def test_on_by_default_and_the_flag_turns_it_off():
    from logra_megatron.config import parse_train_args

    assert parse_train_args([]).run.balance_batch is True
    assert parse_train_args(["--no-balance-batch"]).run.balance_batch is False


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("balancing_checks.py", 2, tmp_path_factory.mktemp("balancing_checks"))


@pytest.mark.parametrize("rank", [0, 1])
def test_exchange_keeps_every_row_once(results, rank):
    values = result(results, "rows", rank)
    assert values["before"] == values["after"], values  # the same multiset of rows over the replicas
    ids = [row[0] for row in values["after"]]
    assert sorted(ids) == list(range(8)), values  # each of the 8 rows once
    assert values["moved"] > 0, values  # the balancing did move rows (not trivially equal)
    assert values["ratio_after"] < values["ratio_before"], values
    assert values["counts_kept"], values


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_balanced_loss_and_gradient_equal_unbalanced(results, mode):
    for rank in (0, 1):
        values = result(results, mode, rank)
        assert values["grad_scale"] > 0 and abs(values["loss"]) > 0, values
        assert values["loss_diff"] <= 1e-6 * max(1.0, abs(values["loss"])), values
        assert values["grad_diff"] <= 1e-6 * max(1.0, values["grad_scale"]), values
        assert values["moved"] > 0, values  # the balanced batch did differ from the replica's own
