"""Every registered reward on hand-written right, wrong and malformed completions."""

import threading

import pytest

from logra_megatron.errors import UserError
from logra_megatron.rl.rewards import (
    available_rewards,
    check_reward_fits_task,
    code_block,
    code_tests_program,
    ends_with_marked_answer,
    extract_final_answer,
    get_reward,
    register_reward,
    reward_needs,
    same_answer,
    weighted_reward,
)
from logra_megatron.rl.tasks import ArithmeticTasks, make_tasks

ARITHMETIC = ArithmeticTasks().record(12, "+", 7)  # "12+7=" -> "19"


# --- registry ----------------------------------------------------------------------------------

def test_registry_lists_every_reward_and_rejects_unknown_names():
    assert {"exact_match", "format", "math_verify", "basic_arithmetic", "chain_sum",
            "gsm_symbolic", "reasoning_gym"} <= set(available_rewards())
    with pytest.raises(UserError) as error:
        get_reward("exact")
    assert "unknown reward 'exact'" in str(error.value)
    assert "exact_match" in str(error.value) and "math_verify" in str(error.value)


def test_register_a_new_reward_and_duplicates():
    @register_reward("test_length_penalty")
    def length_penalty(prompt_record, completion_text):
        return -len(completion_text) / 100

    assert get_reward("test_length_penalty")(ARITHMETIC, "abc") == pytest.approx(-0.03)
    assert get_reward("test_length_penalty")(ARITHMETIC, None) == 0.0  # None counts as ""
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(length_penalty)


def test_weighted_reward():
    reward = weighted_reward({"exact_match": 1.0, "format": 0.1})
    assert reward(ARITHMETIC, "19") == pytest.approx(1.1)
    assert reward(ARITHMETIC, "18") == pytest.approx(0.1)
    assert reward(ARITHMETIC, "eighteen") == 0.0
    with pytest.raises(UserError):
        weighted_reward({"nope": 1.0})


# --- extraction --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("<answer>42</answer>", "42"),
    ("I think <answer>7</answer> no wait <answer> 8 </answer>", "8"),
    (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{3} then \boxed{4}", "4"),
    ("18 + 54 = 72\n#### 72", "72"),
    ("Answer: -5.", "-5"),
    ("The final answer is: **42**.", "42"),
    ("**Answer:** $7$", "7"),
    ("The answer is 1,234", "1,234"),
    ("first 3, then 1,250.5 apples", "1250.5"),
    ("12 - 3 = 9", "9"),
    ("no digits here", None),
    ("", None),
    (r"cut off \boxed{12", "12"),  # unbalanced box: falls back to the last number
    ("<answer></answer>", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("work...\n<answer>5</answer>", True),
    (r"so the result is $\boxed{5}$.", True),
    ("work\n#### 72\n", True),
    ("work\nAnswer: 12", True),
    ("work\n**Final answer:** 12", True),
    ("work\nAnswer: **", False),
    (r"\boxed{5} and then more words", False),
    ("the answer is 5", False),
    ("just 5", False),
    ("<answer></answer>", False),
    ("", False),
])
def test_ends_with_marked_answer(text, expected):
    assert ends_with_marked_answer(text) is expected


# --- exact match and format --------------------------------------------------------------------

@pytest.mark.parametrize("completion,expected", [
    ("19", 1.0), (" 19\n", 1.0), ("18", 0.0), ("19 19", 0.0), ("190", 0.0), ("", 0.0), (None, 0.0),
])
def test_exact_match(completion, expected):
    assert get_reward("exact_match")(ARITHMETIC, completion) == expected


@pytest.mark.parametrize("completion,expected", [
    ("19", 1.0), ("18", 1.0), ("-3", 1.0), ("19=", 0.0), ("nineteen", 0.0), ("", 0.0),
])
def test_format_with_an_answer_pattern(completion, expected):
    assert get_reward("format")(ARITHMETIC, completion) == expected


def test_format_without_a_pattern_needs_a_marked_final_answer():
    record = {"prompt": "How many?", "answer": "3"}
    reward = get_reward("format")
    assert reward(record, "count them\n<answer>4</answer>") == 1.0  # format, not correctness
    assert reward(record, "it is 3") == 0.0
    assert reward(record, None) == 0.0


# --- reasoning-gym -----------------------------------------------------------------------------

def wrong_answer(answer: str) -> str:
    return str(int(answer) + 1)


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_reasoning_gym_rewards_right_wrong_and_malformed(task):
    reward = get_reward(task)
    for record in make_tasks(task, 3, seed=5):
        answer = record["answer"]
        for right in (answer, f"Let me think.\n<answer>{answer}</answer>", rf"so $\boxed{{{answer}}}$",
                      f"step one, step two\nAnswer: {answer}", f"3 + 4 = 7 ... total {answer}"):
            assert reward(record, right) == 1.0, (record, right)
        wrong = reward(record, f"<answer>{wrong_answer(answer)}</answer>")
        # reasoning-gym's gsm_symbolic gives 0.01 for a wrong number; the others 0.
        assert wrong == (0.01 if task == "gsm_symbolic" else 0.0), (record, wrong)
        for malformed in ("I don't know", "", None):
            assert reward(record, malformed) == 0.0
        assert get_reward("reasoning_gym")(record, answer) == 1.0


def test_reasoning_gym_partial_credit_is_reasoning_gyms_own_rule():
    record = make_tasks("basic_arithmetic", 1, seed=0)[0]
    answer = record["answer"]
    # basic_arithmetic scores a reference contained in a longer answer len(ref)/len(answer).
    expected = len(answer) / len(f"{answer} apples")
    assert get_reward("basic_arithmetic")(record, f"Answer: {answer} apples") == pytest.approx(expected)


def test_reasoning_gym_reward_for_an_unknown_task():
    with pytest.raises(UserError, match="reasoning-gym does not know"):
        get_reward("reasoning_gym")({"task": "no_such", "answer": "1", "prompt": "?"}, "1")


# --- math-verify -------------------------------------------------------------------------------

@pytest.mark.parametrize("reference,completion,expected", [
    ("1/2", r"The probability is $\boxed{0.5}$.", 1.0),
    ("1/2", r"\boxed{\frac{2}{4}}", 1.0),
    (r"$\frac{1}{2}$", "0.5", 1.0),
    ("0.5", r"\boxed{\frac{1}{2}}", 1.0),
    ("72", "48 + 24 = 72\n#### 72", 1.0),
    ("72", "#### 72\nI also considered 5 boxes", 1.0),  # the #### line wins over later numbers
    ("Natalia sold 48/2 = 24 clips.\n#### 72", r"\boxed{72}", 1.0),  # GSM8K-style reference
    ("72", "<answer>72</answer>", 1.0),
    ("1/2", r"\boxed{0.6}", 0.0),
    ("72", "#### 73", 0.0),
    ("72", "I have no idea", 0.0),
    ("72", "", 0.0),
    ("72", None, 0.0),
    ("72", r"\boxed{", 0.0),
    ("72", "#### ", 0.0),
])
def test_math_verify(reference, completion, expected):
    assert get_reward("math_verify")({"prompt": "?", "answer": reference}, completion) == expected


def test_math_verify_works_outside_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(
        get_reward("math_verify")({"answer": "1/2"}, r"\boxed{0.5}")))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_arithmetic_partial_reward_on_right_wrong_and_malformed_completions():
    from logra_megatron.rl.rewards import get_reward

    reward = get_reward("arithmetic_partial")
    record = {"prompt": "12+7=", "answer": "19"}
    assert reward(record, "19") == 1.0
    assert reward(record, " 19\n") == 1.0
    assert reward(record, "18") == 0.25  # one of two digits right: half credit per digit
    assert reward(record, "91") == 0.0
    assert reward(record, "7") == 0.0  # wrong length
    assert reward(record, "1x") == 0.0  # not a number
    assert reward(record, "") == 0.0


# --- final answer (chat-form short answers) ---------------------------------------------------

@pytest.mark.parametrize("completion,expected", [
    ("12 + 7 is \\boxed{19}.", 1.0), ("\\boxed{19.0}", 1.0), ("<answer> 19 </answer>", 1.0),
    ("I get 18, no wait: 19", 1.0), ("\\boxed{18}", 0.0), ("\\boxed{19} or \\boxed{20}", 0.0), ("", 0.0),
    ("nineteen", 0.0),
])
def test_final_answer(completion, expected):
    assert get_reward("final_answer")(ARITHMETIC, completion) == expected


def test_same_answer_compares_text_or_numbers():
    assert same_answer("1,000", "1000") and same_answer("0.50", ".5") and same_answer("$x+1$", "x+1")
    assert not same_answer("1000", "100") and not same_answer(None, "1") and not same_answer("1e400", "1e401")


def test_rewards_say_what_they_need_from_a_task():
    assert reward_needs("exact_match") == {"answer"} and reward_needs("code_tests") == {"tests"}
    assert reward_needs("format") == frozenset() and reward_needs("chain_sum") == {"reasoning_gym:chain_sum"}
    check_reward_fits_task("chain_sum", "chain_sum", frozenset({"answer", "reasoning_gym", "reasoning_gym:chain_sum"}))
    with pytest.raises(UserError, match="--reward chain_sum cannot score --task gsm_symbolic"):
        check_reward_fits_task("chain_sum", "gsm_symbolic", frozenset({"reasoning_gym", "reasoning_gym:gsm_symbolic"}))
    with pytest.raises(UserError, match="did you mean chain_sum"):
        get_reward("chain_summ")


# --- code blocks (chat-form code completions) -------------------------------------------------

def test_code_block_prefers_the_block_that_defines_the_entry_point():
    text = "Use it like:\n```python\nprint(add(1, 2))\n```\nwhere\n```py\ndef add(a, b):\n    return a + b\n```\n"
    assert code_block(text, "add") == "def add(a, b):\n    return a + b\n"
    assert code_block(text, None) == "def add(a, b):\n    return a + b\n"  # the last block
    assert code_block("```\nx = 1\n```", "f") == "x = 1\n"
    assert code_block("```python\ndef f():\n    return 1", "f") == "def f():\n    return 1"  # cut off
    assert code_block("    return a + b\n", "add") is None  # a bare continuation


def test_code_tests_program_with_a_code_block_keeps_the_prompts_imports():
    record = {"prompt": "from math import sqrt\n\ndef root(x):\n    \"\"\"Square root.\"\"\"\n",
              "metadata": {"test": "def check(f):\n    assert f(9) == 3\n", "entry_point": "root",
                           "include_prompt": True}}
    reply = "Sure:\n```python\ndef root(x):\n    return sqrt(x)\n```"
    program = code_tests_program(record, reply)
    assert program.startswith(record["prompt"] + "\ndef root(x):\n    return sqrt(x)\n") and "Sure" not in program
    assert get_reward("code_tests")(record, reply) == 1.0
    assert get_reward("code_tests")(record, reply.replace("sqrt(x)", "x / 2")) == 0.0
    assert get_reward("code_tests")(record, "    return sqrt(x)\n") == 1.0  # bare continuation, as before
