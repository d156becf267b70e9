"""Preemption (rl/preemption.py; Megatron's --exit-signal-handler): a run sent SIGTERM finishes
the RL step in flight, saves that iteration and exits 0 with a line saying so, and the run
resumed from it ends exactly as the uninterrupted one did; under torchrun a signal that reaches
one rank stops every rank after the same step. The signal is sent from a named point
(``LOGRA_MEGATRON_KILL_AT=rl:step:<n>`` with ``LOGRA_MEGATRON_KILL_SIGNAL=SIGTERM``: at the
start of the n-th RL step, so that step is the one in flight).

The runs decay the KL budget on a cosine (``--kl-target-final``): the budget each step logged is
the schedule's, and the resumed run continues it exactly."""

import json
import os
import signal
import subprocess
import sys

import pytest
from dist_harness import REPO, descendants
from test_train import assert_not_degenerate, assert_same_weights, metrics, saved_weights

from logra_megatron.faults import KILL_AT_ENV, KILL_SIGNAL_ENV
from logra_megatron.rl.preemption import ExitSignalHandler
from logra_megatron.training.kl_control import scheduled_kl_target

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
RUN = ["--warmup-iters", "30", "--max-operand", "4", "--train-iters", "4", "--eval-prompts", "8",
       "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "8", "--kl-probe-sequences", "4",
       "--no-progress", "--lr", "1e-3", "--kl-target", "0.01", "--kl-target-final", "0.002",
       "--kl-target-schedule", "cosine"]
COMPARED = ("reward_mean", "reward_std", "loss", "pg_loss", "entropy", "grad_norm", "kl_pred", "step_scale", "lr",
            "kl_budget")


def train(args, signal_at=None, nproc=1, timeout=300):
    env = dict(ENV)
    if signal_at:
        env.update({KILL_AT_ENV: signal_at, KILL_SIGNAL_ENV: "SIGTERM"})
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "logra_megatron.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a run that hangs (ranks that disagree): all of it goes
        for pid in [proc.pid, *descendants(proc.pid)]:  # (torchrun starts its ranks in sessions of their own)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout} s)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def iterations(root):
    return sorted(name for name in os.listdir(root) if name.startswith("iter_"))


def test_sigterm_saves_the_step_in_flight_and_the_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    """Also: the resumed run's KL budget continues the schedule (``kl_budget`` is compared)."""
    whole = tmp_path / "whole"
    proc = train([*RUN, "--output-dir", str(whole), "--save", str(tmp_path / "whole-ckpt")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    budgets = [row["kl_budget"] for row in metrics(whole)]
    assert budgets == pytest.approx([scheduled_kl_target("cosine", 0.01, 0.002, step, 4) for step in range(4)],
                                    rel=1e-12)
    assert budgets[0] == 0.01 and budgets[3] == pytest.approx(0.002)

    # SIGTERM arrives as RL step 1 (the second) starts: that step finishes, iteration 2 is saved.
    ckpt, first = tmp_path / "ckpt", tmp_path / "first"
    proc = train([*RUN, "--output-dir", str(first), "--save", str(ckpt)], signal_at="rl:step:2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"preempted by SIGTERM: stopped after iteration 2 and saved {ckpt}/iter_0000002; " \
           f"continue with --load {ckpt}" in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr
    assert iterations(ckpt) == ["iter_0000002"]  # no --save-interval: the save is the preemption's
    state = json.loads((ckpt / "iter_0000002" / "trainer_state.json").read_text())
    assert state["step"] == 2
    summary = json.loads((first / "summary.json").read_text())
    assert summary["preempted_by"] == "SIGTERM" and summary["finished"] is False and summary["steps"] == 2
    assert "held_out_accuracy_after" not in summary
    assert [row["step"] for row in metrics(first)] == [0, 1]

    resumed = tmp_path / "resumed"
    proc = train([*RUN, "--output-dir", str(resumed), "--load", str(ckpt), "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, expected = metrics(resumed), metrics(whole)[2:]
    assert [row["step"] for row in got] == [2, 3]
    assert_not_degenerate(got[1:])
    for ours, theirs in zip(got, expected):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key
    ends = [json.loads((folder / "summary.json").read_text()) for folder in (resumed, whole)]
    assert ends[0]["finished"] and ends[0]["held_out_accuracy_after"] == ends[1]["held_out_accuracy_after"]
    assert ends[0]["evaluation_after"] == ends[1]["evaluation_after"]
    assert_same_weights(saved_weights(ckpt), saved_weights(tmp_path / "whole-ckpt"), rtol=1e-6, atol=1e-7)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Only rank 1 is signalled (as it starts RL step 1); rank 0 learns it at the step boundary,
    and both save iteration 2 and exit 0 (without the agreement rank 1 would leave rank 0 alone
    in the next step's collectives)."""
    ckpt = tmp_path / "ckpt"
    proc = train([*RUN, "--warmup-iters", "0", "--output-dir", str(tmp_path / "out"), "--save", str(ckpt)],
                 signal_at="rl:step:2@1", nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "preempted by SIGTERM: stopped after iteration 2" in proc.stdout, proc.stdout[-3000:]
    assert iterations(ckpt) == ["iter_0000002"]
    assert [row["step"] for row in metrics(tmp_path / "out")] == [0, 1]


def test_without_save_the_run_stops_all_the_same_and_says_nothing_was_saved(tmp_path):
    proc = train([*RUN, "--warmup-iters", "0", "--output-dir", str(tmp_path / "out")], signal_at="rl:step:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preempted by SIGTERM: stopped after iteration 1; nothing was saved (no --save)" in proc.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["preempted_by"] == "SIGTERM" and summary["steps"] == 1 and not summary["finished"]


def test_without_the_handler_sigterm_ends_the_run_at_once(tmp_path):
    proc = train([*RUN, "--warmup-iters", "0", "--output-dir", str(tmp_path / "out"), "--save",
                  str(tmp_path / "ckpt"), "--no-exit-signal-handler"], signal_at="rl:step:2")
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()


def test_the_handler_records_the_first_signal_and_restores_the_previous_handlers():
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda number, frame: seen.append(number))
    try:
        with ExitSignalHandler(["SIGTERM", "SIGUSR1"]) as handler:
            assert handler.stop_requested() is None
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
            assert handler.stop_requested() == "SIGUSR1" and seen == []
        assert seen == []  # a run that ends normally after a signal: the signal was its to handle
        # A run that fails after a signal (a peer rank died, torchrun stops the others): the
        # signal is sent again, to the previous handler (by default: the process ends).
        with pytest.raises(RuntimeError, match="peer"):
            with ExitSignalHandler(["SIGUSR1"]):
                os.kill(os.getpid(), signal.SIGUSR1)
                raise RuntimeError("Connection closed by peer")
        assert seen == [signal.SIGUSR1]
        with ExitSignalHandler(["SIGUSR1"], enabled=False) as handler:  # --no-exit-signal-handler
            os.kill(os.getpid(), signal.SIGUSR1)
            assert handler.stop_requested() is None and seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_an_output_dir_that_cannot_be_created_is_one_error_line():
    proc = train(["--output-dir", "/proc/logra-preemption-test/run"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --output-dir /proc/logra-preemption-test/run: cannot "
                                                   "create a directory there (in /proc)"), proc.stderr


def test_save_dirs_and_exit_signals_are_checked_with_the_flags(capsys):
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import UserError

    with pytest.raises(UserError, match="--save /proc/logra-preemption-test: cannot create a directory there"):
        parse_train_args(["--save", "/proc/logra-preemption-test"], world_size=1)
    assert parse_train_args(["--exit-signal", "usr1, SIGTERM,TERM"], world_size=1).run.exit_signal == \
        "SIGUSR1,SIGTERM"
    assert parse_train_args([], world_size=1).run.exit_signal == "SIGTERM,SIGUSR1"
    for text in ("SIGKILL", "", "TERM;USR1"):
        with pytest.raises(SystemExit) as stop:
            parse_train_args(["--exit-signal", text], world_size=1)
        error = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and error.startswith("error: logra_megatron.train: argument --exit-signal:") and \
            "is not one of SIGTERM, SIGUSR1" in error and "\n" not in error, error
