"""Crash safety of the trainer's checkpoints, end to end (real runs of ``python -m
logra_megatron.train``):

- a run killed with SIGKILL at >= 20 seeded moments of its saves (before, during and after the
  tensor writes, after the state write, after the rename) resumes each time from a complete
  checkpoint, and its metrics equal the uninterrupted run's, in a configuration whose weights
  move (non-zero advantages, a KL forecast, a realized KL every 2 steps);
- every kind of bad checkpoint ends with one ``error:`` line naming it and exit 2.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from logra_megatron.checkpoint_layout import (incomplete_reason, iteration_dir, iterations, remove_partials,
                                              write_manifest)
from logra_megatron.faults import KILL_AT_ENV, NAN_AT_ENV

STEPS = 14
RUN = ["--warmup-iters", "30", "--max-operand", "4", "--train-iters", str(STEPS), "--eval-prompts", "8", "--prompts-per-step", "4",
       "--group-size", "4", "--micro-batch-size", "8", "--kl-probe-sequences", "4", "--kl-realized-interval", "2",
       "--logra-refresh-interval", "3", "--lr", "1e-3", "--no-progress", "--save-interval", "1"]
COMPARED = ("reward_mean", "reward_std", "accuracy", "loss", "pg_loss", "entropy", "grad_norm", "kl_pred",
            "kl_realized", "step_scale", "lr", "skipped")
SAVE_PHASES = ("save:start", "save:tensors", "save:state", "save:published")


class Finished:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def train(args, env=None, timeout=300, on_start=None):
    """Run the trainer in its own session, output to files (a pipe would wait for any process
    the killed trainer left behind); afterwards nothing of that session may still be alive."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "logra_megatron.train", *args], stdout=out, stderr=err,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        if on_start is not None:
            on_start(proc)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            leftovers = _session_members(proc.pid)
            # Children killed with the trainer may take a moment to go: CI saw one still in its exit
            # path after 5 s on a loaded machine. A real leftover lives on; the grace costs nothing
            # when there is none.
            deadline = time.time() + 30.0
            while leftovers and time.time() < deadline:
                time.sleep(0.1)
                leftovers = _session_members(proc.pid)
            if leftovers or proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert not leftovers, f"processes outlived the trainer: {[_command(pid) for pid in leftovers]}"
        out.seek(0)
        err.seek(0)
        return Finished(code, out.read(), err.read())


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as handle:
            return handle.read().replace("\0", " ")[:300]
    except OSError:
        return str(pid)


def _state(pid: str) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


def _session_members(session: int) -> list:
    """The live processes of ``session``: not zombies, and not processes already in their exit
    path (their memory released: an empty command line; CI once saw one take over 5 s to go)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session and _state(entry) not in ("Z", "X") and _command(int(entry)):
                    members.append(int(entry))
            except OSError:
                pass
    return members


def rl_rows(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [row for row in rows if row["phase"] == "rl"]


def newest_complete(root):
    done = [number for number, directory in iterations(root) if incomplete_reason(directory) is None]
    return max(done) if done else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("whole")
    proc = train([*RUN, "--output-dir", str(base / "out"), "--save", str(base / "ckpt"), "--keep-checkpoints", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(base / "out")
    # Not a degenerate run: rewards differ within groups, the policy moves, the forecast is live.
    assert any(row["reward_std"] > 0 for row in rows) and any(abs(row["loss"]) > 0 for row in rows)
    assert sum(row["grad_norm"] > 0 for row in rows) >= STEPS // 2 and all(row["kl_pred"] > 0 for row in rows)
    assert sum(row["kl_realized"] is not None for row in rows) == STEPS // 2
    assert [number for number, _ in iterations(base / "ckpt")] == [STEPS - 2, STEPS - 1, STEPS]  # --keep-checkpoints 3
    return base, rows


def kill_when_saving(args, delay_s):
    """Run and SIGKILL the trainer ``delay_s`` after a save's partial directory first appears:
    a moment inside the tensor writes or just after, chosen by the clock."""
    root = args[args.index("--save") + 1]

    def watch(proc):
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            if os.path.isdir(root) and any(name.endswith(".partial") for name in os.listdir(root)):
                time.sleep(delay_s)
                proc.send_signal(signal.SIGKILL)
                return
            time.sleep(0.002)

    return train(args, on_start=watch).returncode


def test_killed_during_saves_resumes_from_a_complete_checkpoint_with_identical_metrics(uninterrupted, tmp_path):
    _, whole = uninterrupted
    out, root = str(tmp_path / "out"), str(tmp_path / "ckpt")
    args = [*RUN, "--output-dir", out, "--save", root, "--load", root]
    rng = random.Random(2026)
    trials = []
    while len(trials) < 22:
        done = newest_complete(root) or 0
        external = len(trials) % 5 == 4  # every fifth trial: a kill by the clock, from outside
        if external:
            remove_partials(root)  # (the run's first save would; the watcher must see only new ones)
            code = kill_when_saving(args, rng.uniform(0.0, 0.05))
            point = "clock"
        else:
            point = rng.choice(SAVE_PHASES if done + 1 < STEPS else SAVE_PHASES[:-1])
            count = 2 if rng.random() < 0.2 and done + 2 < STEPS else 1
            proc = train(args, env={KILL_AT_ENV: f"{point}:{count}"})
            code = proc.returncode
            assert code == -signal.SIGKILL, (point, code, trials, proc.stderr[-3000:])
        assert code == -signal.SIGKILL, (point, code, trials)
        after = newest_complete(root) or 0
        assert after >= done, (point, done, after)
        if point in SAVE_PHASES[:-1] and count == 1:
            assert after == done, (point, done, after)  # the interrupted save is not taken
        if point == "save:published":
            assert after == done + count
        trials.append((point, done, after))
    final = train(args)
    assert final.returncode == 0, final.stderr[-3000:]
    resumed = rl_rows(out)
    assert [row["step"] for row in resumed] == list(range(STEPS))  # nothing lost, nothing repeated
    for mine, theirs in zip(resumed, whole):
        for key in COMPARED:
            assert mine[key] == theirs[key], (mine["step"], key, mine[key], theirs[key], trials)
    assert len({point for point, _, _ in trials}) == len(SAVE_PHASES) + 1


@pytest.fixture(scope="module")
def saved(uninterrupted, tmp_path_factory):
    """A copy of the uninterrupted run's checkpoints to damage."""
    base, _ = uninterrupted

    def fresh():
        target = tmp_path_factory.mktemp("damaged") / "ckpt"
        shutil.copytree(base / "ckpt", target)
        return str(target)

    return fresh


def one_error_line(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


FINISHED = ["--train-iters", str(STEPS), "--eval-prompts", "4", "--no-progress"]


@pytest.mark.parametrize("damage", ["truncated_state", "truncated_tensors", "missing_metadata"])
def test_a_damaged_latest_iteration_falls_back_or_is_one_error_line(saved, tmp_path, damage):
    root = saved()
    newest = iteration_dir(root, STEPS)
    if damage == "truncated_state":
        os.truncate(os.path.join(newest, "trainer_state.json"), 10)
    elif damage == "truncated_tensors":
        distcp = sorted(name for name in os.listdir(newest) if name.endswith(".distcp"))[0]
        os.truncate(os.path.join(newest, distcp), 100)
    else:
        os.remove(os.path.join(newest, "metadata.json"))
    asked = train(["--load", root, "--ckpt-step", str(STEPS), *FINISHED, "--output-dir", str(tmp_path / "a")])
    one_error_line(asked, newest, "--ckpt-step")
    latest = train(["--load", root, *FINISHED, "--output-dir", str(tmp_path / "b")])
    assert latest.returncode == 0, latest.stderr[-3000:]
    assert f"skipping checkpoint {newest}" in latest.stdout + latest.stderr


def test_a_damaged_state_file_that_passes_its_manifest_is_one_error_line(saved, tmp_path):
    root = saved()
    newest = iteration_dir(root, STEPS)
    with open(os.path.join(newest, "trainer_state.json"), "w") as handle:
        handle.write('{"step": ')
    write_manifest(newest)  # as if the disk, not the writer, damaged it
    one_error_line(train(["--load", root, *FINISHED, "--output-dir", str(tmp_path)]), "trainer_state.json")


def test_another_architecture_is_one_error_line(saved, tmp_path):
    root = saved()
    newest = iteration_dir(root, STEPS)
    path = os.path.join(newest, "model_config.json")
    config = json.load(open(path))
    config["ffn_hidden"] = config["ffn_hidden"] * 2
    json.dump(config, open(path, "w"))
    write_manifest(newest)
    one_error_line(train(["--load", root, *FINISHED, "--output-dir", str(tmp_path)]), "cannot load checkpoint", newest)


@pytest.mark.parametrize("flags,fragment", [(["--optimizer", "adam"], "--optimizer logra"),
                                            (["--logra-rank", "4"], "--logra-rank 0.5")])
def test_another_optimizer_or_rank_is_one_error_line_naming_the_way_out(saved, tmp_path, flags, fragment):
    root = saved()
    proc = train(["--load", root, *flags, *FINISHED, "--output-dir", str(tmp_path)])
    one_error_line(proc, iteration_dir(root, STEPS), fragment, "--no-load-optim")


def test_no_load_optim_starts_another_optimizer_from_the_weights(saved, tmp_path):
    root = saved()
    proc = train(["--load", root, "--optimizer", "adam", "--no-load-optim", "--train-iters", str(STEPS + 2),
                  "--eval-prompts", "4", "--prompts-per-step", "4", "--group-size", "4", "--no-progress",
                  "--output-dir", str(tmp_path), "--kl-probe-sequences", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [row["step"] for row in rl_rows(tmp_path)] == [STEPS, STEPS + 1]


def test_a_layout_the_checkpoint_cannot_reshard_to_is_one_error_line(saved):
    """Checked before any process group (tiny has 4 heads: TP=3 cannot split them)."""
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import UserError

    root = saved()
    with pytest.raises(UserError, match="iter_"):
        parse_train_args(["--load", root, "--tensor-model-parallel-size", "3"], world_size=3)


def test_non_finite_steps_are_skipped_and_too_many_in_a_row_stop_the_run_after_saving(tmp_path):
    """From the 3rd step on every loss is NaN: steps 3 and 4 are skipped (logged, nothing
    committed), the 2nd skip in a row stops the run with one error line and a checkpoint of the
    last good state, from which a healthy run resumes."""
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    args = [*RUN, "--train-iters", "6", "--save", root, "--output-dir", out, "--max-consecutive-skips", "2"]
    proc = train(args, env={NAN_AT_ENV: "rl:loss:3"})
    one_error_line(proc, "stopping at step 4", "2 consecutive steps were skipped", root)
    rows = rl_rows(out)
    assert [row["skipped"] for row in rows] == [0.0, 0.0, 1.0, 1.0] and rows[-1]["skipped_steps"] == 2.0
    assert rows[2]["lr"] == rows[3]["lr"]  # a skipped step does not advance the schedule
    assert newest_complete(root) == 4
    state = json.load(open(os.path.join(iteration_dir(root, 4), "trainer_state.json")))
    assert state["skipped_steps"] == 2 and state["consecutive_skips"] == 2
    resumed = train([*args, "--load", root])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["skipped"] for row in rl_rows(out)] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
