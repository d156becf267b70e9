"""Rewards that misbehave (raise, hang, hold the GIL, kill their process, return NaN) score 0 for
that completion, are counted, and the run goes on; and the sandboxed ``code_tests`` reward."""

import os
import re
import time

import pytest
from dist_harness import process_children

from logra_megatron.errors import UserError
from logra_megatron.rl.reward_runner import RewardRunner
from logra_megatron.rl.rewards import code_tests_program, get_reward, run_code_tests
from logra_megatron.rl.sandbox import SandboxLimits

RECORD = {"prompt": "12+7=", "answer": "19", "task": "arithmetic", "metadata": {}}
TIMEOUT_S = 1.0
MARGIN_S = 1.5
"""A call returns within the timeout plus this (killing and reaping a worker; a loaded machine)."""


def misbehaving_reward(record, text):
    """Does what the completion says: the test's stand-in for a buggy or adversarial verifier."""
    if text == "raise":
        raise ValueError("cannot parse the answer")
    if text == "hang":
        time.sleep(1000)
    if text == "hold the GIL":  # catastrophic backtracking: C code that never releases the GIL
        re.match(r"(a+)+$", "a" * 64 + "b")
    if text == "die":
        os._exit(3)
    if text == "nan":
        return float("nan")
    return 1.0 if text.strip() == record["answer"] else 0.0


def reward_workers() -> list:
    """Pids of this process's live reward workers."""
    return process_children().get(os.getpid(), [])


@pytest.fixture
def runner():
    with RewardRunner(misbehaving_reward, timeout_s=TIMEOUT_S) as runner:
        yield runner


def timed(function, *args):
    started = time.monotonic()
    result = function(*args)
    return result, time.monotonic() - started


def test_a_raising_reward_scores_zero_and_is_counted(runner):
    (score, failure), _ = timed(runner.score, RECORD, "raise")
    assert score == 0.0 and failure.startswith("error: ValueError: cannot parse the answer")
    assert runner(RECORD, "19") == 1.0  # the next completion is scored as usual
    assert runner.take_failures()["reward_errors"] == 1.0


@pytest.mark.parametrize("text", ["hang", "hold the GIL"])
def test_a_hanging_reward_times_out_and_its_worker_is_replaced(runner, text):
    for attempt in range(3):  # repeated hangs do not pile up workers
        (score, failure), elapsed = timed(runner.score, RECORD, text)
        assert score == 0.0 and failure.startswith(f"timeout: after {TIMEOUT_S:g}s")
        assert elapsed < TIMEOUT_S + MARGIN_S, f"returned after {elapsed:.1f}s"
        assert len(reward_workers()) <= 1
    assert runner(RECORD, "19") == 1.0
    assert runner.take_failures() == {"reward_failures": 3.0, "reward_timeouts": 3.0, "reward_errors": 0.0,
                                      "reward_worker_deaths": 0.0, "reward_invalid": 0.0}
    assert runner.take_failures()["reward_failures"] == 0.0  # counted once, per step


def test_a_reward_that_kills_its_process_or_returns_nan(runner):
    assert runner.score(RECORD, "die") == (0.0, runner.recent_failures[-1])
    assert runner.recent_failures[-1].startswith("worker died: exit code 3")
    assert runner.score(RECORD, "nan")[1].startswith("invalid score: nan")
    assert runner(RECORD, "19") == 1.0
    counts = runner.take_failures()
    assert counts["reward_worker_deaths"] == 1.0 and counts["reward_invalid"] == 1.0
    assert counts["reward_failures"] == 2.0


def test_a_batch_goes_on_past_failures_in_parallel():
    texts = ["19", "hang", "raise", "18", "hang", "19", "die", "19"]
    with RewardRunner(misbehaving_reward, timeout_s=TIMEOUT_S, workers=2) as runner:
        scores, elapsed = timed(runner.score_batch, [RECORD] * len(texts), texts)
        assert len(reward_workers()) <= 2
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert runner.failures == {"timeout": 2, "error": 1, "worker died": 1}
    assert elapsed < TIMEOUT_S + MARGIN_S, f"two hangs on two workers took {elapsed:.1f}s"
    assert not reward_workers()  # closed


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(UserError, match="timeout_s must be a positive number"):
        RewardRunner(misbehaving_reward, timeout_s=0)
    with pytest.raises(UserError, match="workers must be a positive integer"):
        RewardRunner(misbehaving_reward, workers=0)
    with pytest.raises(UserError, match="reward_fn must be callable"):
        RewardRunner("exact_match")
    with pytest.raises(UserError, match="2 prompt records for 1 completions"):
        RewardRunner(misbehaving_reward).score_batch([RECORD, RECORD], ["19"])


# --- the code_tests reward ---------------------------------------------------------------------

HUMAN_EVAL = {
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    "answer": "",
    "task": "humaneval",
    "metadata": {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
                 "entry_point": "add", "include_prompt": True},
}


def test_code_tests_reward_runs_the_completion_against_the_tests():
    reward = get_reward("code_tests")
    assert reward(HUMAN_EVAL, "    return a + b\n") == 1.0
    assert reward(HUMAN_EVAL, "    return a - b\n") == 0.0
    assert reward(HUMAN_EVAL, "    return (\n") == 0.0  # a syntax error
    assert reward(HUMAN_EVAL, None) == 0.0
    program = code_tests_program(HUMAN_EVAL, "    return a + b\n")
    assert program.startswith(HUMAN_EVAL["prompt"] + "    return a + b\n") and program.endswith("check(add)\n")
    result = run_code_tests(HUMAN_EVAL, "    import os\n    return os.system('true')\n",
                            limits=SandboxLimits(wall_s=5.0))
    assert not result.passed and result.reason in ("process creation blocked", "exit status 1: AssertionError")


def test_code_tests_reward_rejects_a_record_without_tests():
    with pytest.raises(UserError, match=r"no metadata\['test'\]"):
        get_reward("code_tests")(RECORD, "print(1)")
    with pytest.raises(UserError, match="entry_point'\\] must be a function name"):
        code_tests_program({**HUMAN_EVAL, "metadata": {"test": "pass", "entry_point": "add; import os"}}, "")


def sandbox_leftovers() -> tuple:
    """(processes, directories) of sandbox runs still on the machine."""
    processes = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if b"logra-sandbox-" in cmdline.read():
                        processes.append(int(entry))
            except OSError:
                pass
    directories = [name for name in os.listdir("/tmp") if name.startswith("logra-sandbox-")]
    return processes, directories


def test_a_hung_program_dies_with_the_worker_that_ran_it():
    """The runner's timeout is shorter than the sandbox's: the killed worker's sandbox must die too,
    and the next run removes the directory it left."""
    record = {**HUMAN_EVAL, "metadata": {**HUMAN_EVAL["metadata"], "entry_point": None,
                                         "test": "import time\ntime.sleep(60)\n"}}
    with RewardRunner(get_reward("code_tests"), timeout_s=TIMEOUT_S) as runner:
        (score, failure), elapsed = timed(runner.score, record, "    return a + b\n")
        assert score == 0.0 and failure.startswith("timeout") and elapsed < TIMEOUT_S + MARGIN_S
        deadline = time.monotonic() + 3.0
        while sandbox_leftovers()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sandbox_leftovers()[0], "the sandbox outlived the worker that ran it"
        assert runner(HUMAN_EVAL, "    return a + b\n") == 1.0  # a new worker; its run sweeps the directory
    assert not sandbox_leftovers()[1], "the killed run's directory was not removed"


def _full_marks(record, text):
    return 1.0


def test_a_worker_forked_after_its_trainer_died_exits_instead_of_waiting_forever():
    """A trainer killed between a worker's fork and its PR_SET_PDEATHSIG sends no signal, and the
    forked worker holds the trainer's end of the pipe too, so no EOF comes: the worker sees it
    has another parent and exits. With its trainer alive it serves."""
    import multiprocessing

    from logra_megatron.rl import reward_runner

    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    # The worker's parent is this process; a trainer pid that is not its parent is a dead trainer.
    orphan = context.Process(target=reward_runner._serve_rewards, args=(theirs, _full_marks, os.getppid()),
                             daemon=True)
    orphan.start()
    orphan.join(10.0)
    if orphan.is_alive():
        orphan.kill()
    assert orphan.exitcode == 0, "the worker kept waiting on a pipe nobody would close"
    ours, theirs = context.Pipe()
    served = context.Process(target=reward_runner._serve_rewards, args=(theirs, _full_marks, os.getpid()),
                             daemon=True)
    served.start()
    ours.send((RECORD, "19"))
    assert ours.poll(10.0) and ours.recv() == ("ok", 1.0)
    ours.close()
    served.kill()
    served.join(10.0)
