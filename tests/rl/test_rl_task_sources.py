"""Task sources behind --task: the registry, each source's records, its held-out split (stable,
disjoint from training), its reward on right and wrong answers, and the config errors (a
malformed JSONL file names its line; a reward that cannot score the task is refused)."""

import gzip
import hashlib
import json
import socket

import pytest

from logra_megatron.config import parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.rl.rewards import get_reward
from logra_megatron.rl.tasks import (REASONING_GYM_TASKS, WITHOUT_REFERENCE_ANSWERS, HumanEvalTasks, JsonlTasks,
                                     ReasoningGymTasks, TaskConfig, build_task_source)
from logra_megatron.rl.tasks.humaneval import humaneval_data_path

# The default run's prompts as the single-file rl/tasks.py drew them before the registry: the
# first training batch (step 0, 16 prompts), the first warm-up batch (16 x 8) and the 150
# held-out problems, joined with "|" and hashed.
DEFAULT_RUN_DIGESTS = {
    "train_step_0": "cc9089fd8edcaf873f2238f9b6583e2c927a30d4b870bbfd5d435d9164ec76f9",
    "warmup_step_0": "f4af9833920c088395f67547f8884cce5c6a38322ad347447c9a499fe1765b25",
    "held_out_150": "8a7149b30b32a4bcec448d6c3b392b0365c2aefa407fe7b0a7ba0eaf94aab66b",
}


def digest(records) -> str:
    return hashlib.sha256("|".join(r["prompt"] + "=>" + r["answer"] for r in records).encode()).hexdigest()


def resolve(*argv):
    return parse_train_args(["--no-progress", *argv], world_size=1)


# --- the default run --------------------------------------------------------------------------

def test_the_default_run_draws_the_same_prompts_as_before_the_registry():
    config = resolve()
    assert config.task.name == "arithmetic" and config.reward.name == "exact_match"
    source = build_task_source(config.task)
    batch = config.rollout.prompts_per_step
    assert digest(source.train_prompts(batch, step=0)) == DEFAULT_RUN_DIGESTS["train_step_0"]
    assert digest(source.train_prompts(batch * config.advantages.group_size, step=100_000)) == \
        DEFAULT_RUN_DIGESTS["warmup_step_0"]
    assert digest(source.held_out(config.run.eval_prompts)) == DEFAULT_RUN_DIGESTS["held_out_150"]


# --- the registry -----------------------------------------------------------------------------

def test_every_registered_reasoning_gym_dataset_but_composite_is_listed():
    from reasoning_gym.factory import DATASETS

    assert set(REASONING_GYM_TASKS) == set(DATASETS) - {"composite"}
    assert len(REASONING_GYM_TASKS) == len(set(REASONING_GYM_TASKS)) > 100


def test_every_listed_dataset_generates_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    without_answers = set()
    for name in REASONING_GYM_TASKS:
        source = ReasoningGymTasks(name, {}, held_out_fraction=0.5, pool_size=1)
        record = source.record(0)
        assert isinstance(record["prompt"], str) and record["prompt"].strip(), name
        assert record["task"] == name and isinstance(record["metadata"], dict)
        if record["answer"] is None:
            without_answers.add(name)
        else:
            assert get_reward(name)(record, "\\boxed{" + record["answer"] + "}") > 0, name
    assert without_answers == WITHOUT_REFERENCE_ANSWERS


@pytest.mark.parametrize("name,close", [("gsm_symbolc", "gsm_symbolic"), ("chainsum", "chain_sum"),
                                        ("arithmetics", "arithmetic"), ("human_eval", "humaneval")])
def test_an_unknown_task_is_one_line_with_close_matches(name, close):
    with pytest.raises(UserError) as error:
        TaskConfig(name=name)
    message = str(error.value)
    assert "\n" not in message and f"unknown task {name!r}" in message and close in message


def test_an_unknown_task_without_close_matches_says_what_exists():
    with pytest.raises(UserError, match="jsonl:PATH"):
        TaskConfig(name="zzzz_qqqq")


# --- reasoning-gym ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chain_sum", "gsm_symbolic"])
def test_reasoning_gym_records_split_and_reward(name):
    source = ReasoningGymTasks(name, {}, held_out_fraction=0.3, seed=1)
    held_out = source.held_out(30)
    again = ReasoningGymTasks(name, {}, held_out_fraction=0.3, seed=2)  # another run seed
    assert held_out == again.held_out(30) and again.held_out(10) == held_out[:10]
    held_prompts = {r["prompt"] for r in held_out}
    assert len(held_prompts) == 30 and all(source.is_held_out(p) for p in held_prompts)
    trained = [r for step in range(20) for r in source.train_prompts(8, step)]
    assert len({r["prompt"] for r in trained}) > 100
    assert not {r["prompt"] for r in trained} & held_prompts
    assert source.train_prompts(8, 3) == ReasoningGymTasks(name, {}, 0.3, seed=1).train_prompts(8, 3)
    assert source.train_prompts(8, 3) != again.train_prompts(8, 3)
    reward = get_reward(source.default_reward(chat=True))
    for record in held_out[:3]:
        assert record["task"] == name and record["answer"]
        assert reward(record, "Adding up ... \\boxed{" + record["answer"] + "}") == 1.0
        assert reward(record, "\\boxed{" + str(int(record["answer"]) + 1) + "}") < 1.0
        assert reward(record, "no idea") == 0.0


def test_reasoning_gym_task_options_reach_the_dataset():
    source = ReasoningGymTasks("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                               held_out_fraction=0.3)
    assert all(r["metadata"]["num_terms"] == 2 for r in source.train_prompts(10))
    config = resolve("--task", "chain_sum", "--task-options", '{"max_terms": 2, "min_terms": 2}')
    assert config.task.options == '{"max_terms": 2, "min_terms": 2}' and config.reward.name == "reasoning_gym"
    with pytest.raises(UserError, match="not valid for the reasoning-gym task chain_sum"):
        resolve("--task", "chain_sum", "--task-options", '{"bogus": 1}')
    with pytest.raises(UserError, match="--task-options"):
        resolve("--task-options", '{"min_terms": 2}')  # arithmetic takes none
    with pytest.raises(SystemExit):
        resolve("--task", "chain_sum", "--task-options", "[1, 2]")


def test_a_dataset_without_reference_answers_needs_no_warmup():
    with pytest.raises(UserError, match="--warmup-iters 0"):
        resolve("--task", "propositional_logic")
    with pytest.raises(UserError, match="reference answer"):
        resolve("--task", "propositional_logic", "--warmup-iters", "0", "--reward", "exact_match")


# --- jsonl ------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_jsonl_records_fields_split_and_reward(tmp_path):
    rows = [{"question": f"What is {i} times 3?", "solution": i * 3, "source": "hand"} for i in range(60)]
    path = write_jsonl(tmp_path / "data.jsonl", rows[:30] + [""] + rows[30:] + [rows[0]])  # a blank line, a repeat
    name = f"jsonl:{path}"
    source = JsonlTasks(name, "question", "solution", held_out_fraction=0.3)
    assert len(source.records) == 60  # the repeat kept once
    record = source.records[7]
    assert record == {"prompt": "What is 7 times 3?", "answer": "21", "task": name, "metadata": {"source": "hand"}}
    held_out = source.held_out(10)
    assert held_out == JsonlTasks(name, "question", "solution", 0.3, seed=9).held_out(10)
    trained = {r["prompt"] for step in range(30) for r in source.train_prompts(8, step)}
    assert len(trained) > 30 and not trained & {r["prompt"] for r in held_out}
    assert 0 < len(held_out) < 60
    assert source.train_prompts(8, 2) != source.train_prompts(8, 3)
    reward = get_reward(source.default_reward(chat=True))
    assert source.default_reward(chat=False) == "final_answer"
    assert reward(record, "7 x 3 = 21, so \\boxed{21}") == 1.0 and reward(record, "\\boxed{21.0}") == 1.0
    assert reward(record, "\\boxed{24}") == 0.0 and reward(record, "") == 0.0
    config = resolve("--task", name, "--prompt-field", "question", "--answer-field", "solution",
                     "--eval-prompts", "10", "--prompts-per-step", "4", "--group-size", "2", "--micro-batch-size", "8")
    assert config.reward.name == "final_answer"


@pytest.mark.parametrize("lines,needle", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": "2"', ""], "line 2 is not valid JSON"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'], "line 2 has no field 'answer' (--answer-field)"),
    (['{"question": "a", "answer": "1"}'], "line 1 has no field 'prompt' (--prompt-field)"),
    (['{"prompt": "a", "answer": "1"}', "", '[1, 2]'], "line 3 must be a JSON object"),
    (['{"prompt": 5, "answer": "1"}'], "line 1: field 'prompt' must be a string"),
    (['{"prompt": "a", "answer": {"x": 1}}'], "line 1: field 'answer' must be a string or a number"),
    (['{"prompt": "  ", "answer": "1"}'], "line 1: field 'prompt' is empty"),
    (["", "  "], "holds no records"),
])
def test_a_malformed_jsonl_file_is_one_line_naming_the_file_and_line(tmp_path, lines, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as error:
        resolve("--task", f"jsonl:{path}")  # at resolve time: before any process group
    message = str(error.value)
    assert "\n" not in message and needle in message and str(path) in message, message


def test_jsonl_paths_that_are_not_files(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(UserError, match="line 1 is not UTF-8"):
        resolve("--task", f"jsonl:{tmp_path / 'latin1.jsonl'}")
    for argv, needle in ((["--task", f"jsonl:{tmp_path / 'missing.jsonl'}"], "does not exist"),
                         (["--task", f"jsonl:{tmp_path}"], "is a directory"), (["--task", "jsonl:"], "path")):
        with pytest.raises(UserError, match=needle):
            resolve(*argv)


def test_jsonl_with_unit_tests_serves_code_tests_and_without_it_does_not(tmp_path):
    rows = [{"prompt": f"def add{i}(a, b):\n", "answer": "    return a + b\n", "entry_point": f"add{i}",
             "include_prompt": True, "test": f"def check(f):\n    assert f(2, {i + 1}) == {3 + i}\n"}
            for i in range(12)]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    source = JsonlTasks(f"jsonl:{path}", "prompt", "answer", held_out_fraction=0.3)
    record = source.records[0]
    assert get_reward("code_tests")(record, "    return a + b\n") == 1.0
    assert get_reward("code_tests")(record, "    return a - b\n") == 0.0
    args = ("--eval-prompts", "2", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch-size", "4")
    assert resolve("--task", f"jsonl:{path}", "--reward", "code_tests", *args).reward.name == "code_tests"
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(12)])
    with pytest.raises(UserError, match="unit tests"):
        resolve("--task", f"jsonl:{plain}", "--reward", "code_tests", *args)


# --- humaneval --------------------------------------------------------------------------------

def test_humaneval_records_split_and_tests():
    with gzip.open(humaneval_data_path(), "rt") as handle:
        assert sum(1 for line in handle if line.strip()) == 164
    source = HumanEvalTasks(held_out_fraction=0.3)
    assert len(source.records) == 164
    held_out = source.held_out(20)
    assert held_out == HumanEvalTasks(held_out_fraction=0.3, seed=5).held_out(20)
    held_prompts = {r["prompt"] for r in source.held_out(len(source._held_out))}
    trained = {r["prompt"] for step in range(20) for r in source.train_prompts(16, step)}
    assert len(held_prompts) + len(source._train) == 164 and not trained & held_prompts
    assert 30 < len(held_prompts) < 70
    reward = get_reward(source.default_reward(chat=False))
    record = held_out[0]
    assert set(record["metadata"]) == {"task_id", "test", "entry_point", "include_prompt"}
    assert reward(record, record["answer"]) == 1.0  # the canonical body passes its tests
    assert reward(record, "    return None\n") == 0.0
    # In chat form the reply is the whole function in a code block, after some words.
    assert reward(record, "Here it is:\n" + source.chat_reply(record) + "\nDone.") == 1.0
    assert reward(record, "```python\ndef " + record["metadata"]["entry_point"] + "(*a):\n    return None\n```") == 0.0


def test_humaneval_in_the_config():
    config = resolve("--task", "humaneval", "--eval-prompts", "20", "--prompts-per-step", "8", "--group-size", "2",
                     "--micro-batch-size", "16", "--preset", "smollm2-135m")  # prompts beyond tiny's 256
    assert config.reward.name == "code_tests"
    with pytest.raises(UserError, match="held-out problems, but humaneval has only"):
        resolve("--task", "humaneval")  # 150 --eval-prompts: more than the split holds


# --- rewards follow the task ------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["--reward", "gsm_symbolic"], "reasoning-gym gsm_symbolic problems"),
    (["--reward", "reasoning_gym"], "any reasoning-gym task"),
    (["--task", "chain_sum", "--reward", "gsm_symbolic"], "reasoning-gym gsm_symbolic problems"),
    (["--reward", "code_tests"], "unit tests"),
])
def test_a_reward_that_cannot_score_the_task_is_refused(argv, needle):
    with pytest.raises(UserError) as error:
        resolve(*argv)
    assert needle in str(error.value) and "--reward" in str(error.value)


def test_a_fitting_reward_overrides_the_tasks_default():
    assert resolve("--task", "chain_sum", "--reward", "chain_sum").reward.name == "chain_sum"
    assert resolve("--reward", "arithmetic_partial").reward.name == "arithmetic_partial"
    assert resolve("--task", "gsm_symbolic", "--reward", "math_verify",
                   "--preset", "smollm2-135m").reward.name == "math_verify"  # prompts beyond tiny's 256 tokens
