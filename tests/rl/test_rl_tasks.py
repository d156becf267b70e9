"""The embedded arithmetic task and offline reasoning-gym task generation."""

import pytest

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks import ArithmeticTaskConfig, ArithmeticTasks, make_tasks


def evaluate(prompt: str) -> int:
    """Python's own arithmetic on the prompt ("12+7=" -> 19)."""
    assert prompt.endswith("=")
    return eval(prompt[:-1], {"__builtins__": {}})


def test_records_are_short_correct_and_non_negative():
    tasks = ArithmeticTasks()
    records = tasks.train_prompts(200, step=0)
    assert len({r["prompt"] for r in records}) == 200  # distinct within a batch
    for record in records:
        assert record["prompt"].endswith("=") and len(record["prompt"]) <= 6
        assert record["answer"] == str(evaluate(record["prompt"]))
        assert int(record["answer"]) >= 0
        assert record["task"] == "arithmetic" and set(record["metadata"]) == {"a", "op", "b"}
    assert {r["metadata"]["op"] for r in records} == {"+", "-"}


def test_training_prompts_never_touch_the_held_out_split():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(max_operand=99, held_out_fraction=0.2))
    held_out = {r["prompt"] for r in tasks.held_out(500)}
    assert len(held_out) == 500 and all(tasks.is_held_out(p) for p in held_out)
    seen = {r["prompt"] for step in range(40) for r in tasks.train_prompts(64, step)}
    assert len(seen) > 1000 and not seen & held_out
    assert not any(tasks.is_held_out(p) for p in seen)


def test_determinism_and_seeds():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(seed=3))
    assert tasks.train_prompts(8, step=5) == tasks.train_prompts(8, step=5)
    assert tasks.train_prompts(8, step=5) != tasks.train_prompts(8, step=6)
    other_seed = ArithmeticTasks(ArithmeticTaskConfig(seed=4))
    assert other_seed.train_prompts(8, step=5) != tasks.train_prompts(8, step=5)
    # The split depends on split_seed only, so changing the training seed keeps the eval set.
    assert other_seed.held_out(20) == tasks.held_out(20)
    assert ArithmeticTasks(ArithmeticTaskConfig(split_seed=1)).held_out(20) != tasks.held_out(20)


def test_configurable_range_and_operations():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(min_operand=0, max_operand=9, operations=("*", "-"),
                                                 allow_negative=True))
    records = tasks.train_prompts(80, step=1)
    assert {r["metadata"]["op"] for r in records} == {"*", "-"}
    assert all(len(r["prompt"]) == 4 for r in records)
    assert any(int(r["answer"]) < 0 for r in records)
    assert all(r["answer"] == str(evaluate(r["prompt"])) for r in records)


def test_too_small_a_problem_space_is_a_user_error():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(min_operand=0, max_operand=2, operations=("+",)))
    with pytest.raises(UserError, match="distinct"):
        tasks.train_prompts(50)


@pytest.mark.parametrize("kwargs", [
    {"min_operand": 5, "max_operand": 1}, {"operations": ()}, {"operations": ("/",)},
    {"held_out_fraction": 0.0}, {"held_out_fraction": 1.0},
])
def test_config_validation(kwargs):
    with pytest.raises(UserError):
        ArithmeticTaskConfig(**kwargs)


def test_make_tasks_arithmetic():
    records = make_tasks("arithmetic", 5, seed=2, max_operand=20)
    assert records == make_tasks("arithmetic", 5, seed=2, max_operand=20)
    assert all(r["metadata"]["a"] <= 20 for r in records)
    with pytest.raises(UserError, match="arithmetic"):
        make_tasks("arithmetic", 5, seed=2, nonsense=1)


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_make_tasks_reasoning_gym(task):
    records = make_tasks(task, 4, seed=11)
    assert len(records) == 4
    assert records == make_tasks(task, 4, seed=11)
    assert records != make_tasks(task, 4, seed=12)
    for record in records:
        assert record["task"] == task
        assert isinstance(record["prompt"], str) and record["prompt"]
        assert isinstance(record["answer"], str) and record["answer"]
        assert "metadata" in record


def test_make_tasks_options_and_errors():
    records = make_tasks("chain_sum", 10, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert all(r["metadata"]["num_terms"] == 2 for r in records)
    with pytest.raises(UserError, match="unknown task 'no_such_task'"):
        make_tasks("no_such_task", 2, seed=0)
    with pytest.raises(UserError, match="chain_sum"):
        make_tasks("chain_sum", 2, seed=0, not_an_option=3)
    assert make_tasks("chain_sum", 0, seed=0) == []
