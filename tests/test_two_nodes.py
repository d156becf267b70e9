"""Two "nodes" on this machine, as a cluster starts them: one torchrun per node (2 ranks each, gloo),
rendezvous over c10d, each node in a working directory of its own (what nodes without a shared
filesystem look like):

- the smoke job at TP2 x DP2 runs over both nodes;
- the trainer with a --save that is not one directory for every node stops before training with one
  ``error:`` line naming the requirement (docs/MULTI_NODE.md);
- the trainer with --save on a directory both nodes share saves, and a second run resumes from it at
  the saved iteration;
- an error found on node 1 alone is said in node 1's log.

c10d rendezvous ignores ``--node-rank`` (torchrun says so) and numbers the nodes by their address:
``--local-addr 127.0.0.1`` / ``127.0.0.2`` (both loopback) makes node 0 the one with ranks 0 and 1.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import REPO, descendants, free_port

from logra_megatron.checkpoint_layout import TRACKER_FILE, incomplete_reason, iteration_dir, iterations
from logra_megatron.rl.checkpointing import SHARED_CHECK_PREFIX, shared_checkpoint_problem

TIMEOUT_S = 300
AFTER_FAILURE_S = 60
"""How long the other node may still run once one node's torchrun failed (its ranks notice the
lost peers in their next collective)."""
TRAIN = ["--tensor-model-parallel-size", "2", "--warmup-iters", "3", "--train-iters", "3", "--eval-prompts", "4",
         "--prompts-per-step", "4", "--group-size", "2", "--micro-batch-size", "4", "--kl-probe-sequences", "4",
         "--no-progress"]


def _kill(proc) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class Nodes:
    """What the two torchruns ended with: ``codes[node]``, ``outputs[node]`` (stdout and stderr)."""

    def __init__(self, codes, outputs, note=""):
        self.codes, self.outputs, self.note = codes, outputs, note

    def tails(self, chars: int = 4000) -> str:
        text = "".join(f"\n--- node {node} (exit {code}) ---\n{output[-chars:]}"
                       for node, (code, output) in enumerate(zip(self.codes, self.outputs)))
        return f"{self.note}{text}"


def two_nodes(module: str, args, cwds, logs) -> Nodes:
    """``python -m torch.distributed.run --nnodes 2 --node-rank N --nproc-per-node 2 --rdzv-backend c10d
    --rdzv-endpoint 127.0.0.1:PORT -m module args`` once per node, node N in ``cwds[N]``; waits for
    both, kills both (and their ranks) when time runs out or a node hangs on after the other failed."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    os.makedirs(logs, exist_ok=True)
    procs, files = [], []
    try:
        for node, cwd in enumerate(cwds):
            handle = open(os.path.join(logs, f"{module}-node{node}-{port}.log"), "w+")
            files.append(handle)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--local-addr", f"127.0.0.{node + 1}", "-m", module, *map(str, args)],
                cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True))
        deadline, note = time.monotonic() + TIMEOUT_S, ""
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs):
                deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
            if time.monotonic() > deadline:
                note = "(killed: a node ran past its time)\n"
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
    outputs = []
    for handle in files:
        handle.seek(0)
        outputs.append(handle.read())
        handle.close()
    return Nodes([proc.returncode for proc in procs], outputs, note)


def error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("error:")]


def worker_traceback(text: str) -> bool:
    """A traceback through this project's code (torchrun's own, when a rank exits 2, is not one)."""
    return bool(re.search(r'File ".*logra_megatron/', text))


def node_dirs(tmp_path):
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    return cwds


def test_the_smoke_job_runs_at_tp2_dp2_over_two_nodes(tmp_path):
    cwds = node_dirs(tmp_path)
    nodes = two_nodes("logra_megatron.smoke", ["--tensor-model-parallel-size", "2", "--train-iters", "3",
                                               "--report-json", "report.json"], cwds, tmp_path / "logs")
    assert nodes.codes == [0, 0], nodes.tails()
    first = nodes.outputs[0]
    assert "smoke: preset=tiny params=180,800 tp=2 pp=1 dp=2 optimizer=adam" in first, nodes.tails()
    losses = [float(line.split()[3]) for line in first.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], nodes.tails()
    # Rank 0 (node 0) wrote every rank's coordinates, relative to its own working directory: four
    # ranks, node 1's two (ranks 2 and 3) the second data-parallel replica's TP pair.
    report = json.loads((cwds[0] / "report.json").read_text())
    assert report["world_size"] == 4 and (report["tp"], report["pp"], report["dp"]) == (2, 1, 2)
    assert [(rank["rank"], rank["tp"], rank["dp"]) for rank in report["ranks"]] == \
        [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert os.listdir(cwds[1]) == []  # node 1's ranks write nothing of their own


def test_the_trainer_refuses_a_save_directory_the_nodes_do_not_share(tmp_path):
    """A relative --save in each node's own directory: two directories. One error line, on rank 0,
    before any training; exit 2 on every rank (torchrun reports it and exits 1)."""
    cwds = node_dirs(tmp_path)
    nodes = two_nodes("logra_megatron.train", [*TRAIN, "--save", "ckpt", "--output-dir", "out"], cwds,
                      tmp_path / "logs")
    assert nodes.codes[0] != 0 and nodes.codes[1] != 0 and not nodes.note, nodes.tails()
    lines = error_lines(nodes.outputs[0])
    assert len(lines) == 1 and error_lines(nodes.outputs[1]) == [], nodes.tails()
    assert lines[0].startswith("error: --save ckpt is not one directory shared by every rank: ranks 2, 3 "
                               "(node 1 on host "), lines[0]
    assert f"rank 0 wrote in {cwds[0] / 'ckpt'}; they look in {cwds[1] / 'ckpt'}" in lines[0], lines[0]
    assert "needs --save on a filesystem all nodes share" in lines[0], lines[0]
    for output in nodes.outputs:  # every rank stopped with exit 2, none with a traceback of ours
        assert re.search(r"exitcode\s*:\s*2", output) and not worker_traceback(output), nodes.tails()
    # Stopped before training: no output directory, nothing saved, the marker removed.
    assert not (cwds[0] / "out").exists() and not (cwds[1] / "out").exists()
    assert os.listdir(cwds[0] / "ckpt") == [] and os.listdir(cwds[1] / "ckpt") == []


def test_the_trainer_saves_on_a_shared_directory_and_resumes_at_the_saved_iteration(tmp_path):
    """--save on a directory both nodes see (an absolute path; the working directories stay apart):
    the run stops after iteration 2 (--exit-interval) and saves it; a second run with --load resumes
    there (no warm-up again, RL step 2 only) and publishes iteration 3."""
    cwds = node_dirs(tmp_path)
    shared = tmp_path / "shared" / "ckpt"
    first = two_nodes("logra_megatron.train", [*TRAIN, "--save", shared, "--exit-interval", "2", "--output-dir",
                                               "first"], cwds, tmp_path / "logs")
    assert first.codes == [0, 0], first.tails()
    assert [number for number, _ in iterations(shared)] == [2], first.tails()
    assert incomplete_reason(iteration_dir(shared, 2)) is None
    assert (shared / TRACKER_FILE).read_text().strip() == "2"
    assert json.loads((Path(iteration_dir(shared, 2)) / "trainer_state.json").read_text())["step"] == 2
    summary = json.loads((cwds[0] / "first" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["finished"] is False and summary["data_parallel_size"] == 2
    assert [(row["phase"], row["step"]) for row in rows(cwds[0] / "first")] == \
        [("warmup", 0), ("warmup", 1), ("warmup", 2), ("rl", 0), ("rl", 1)]

    second = two_nodes("logra_megatron.train", [*TRAIN, "--save", shared, "--load", shared, "--output-dir",
                                                "second"], cwds, tmp_path / "logs")
    assert second.codes == [0, 0], second.tails()
    resumed = rows(cwds[0] / "second")
    assert [(row["phase"], row["step"]) for row in resumed] == [("rl", 2)], second.tails()
    ended = json.loads((cwds[0] / "second" / "summary.json").read_text())
    assert ended["steps"] == 3 and ended["finished"] is True
    # The trainer state came from the checkpoint: the first run's start-of-run evaluation.
    assert ended["evaluation_initial"] == summary["evaluation_initial"]
    assert [number for number, _ in iterations(shared)] == [2, 3]
    assert (shared / TRACKER_FILE).read_text().strip() == "3"
    assert not [name for name in os.listdir(shared) if name.startswith(SHARED_CHECK_PREFIX) or
                name.endswith(".partial")]
    assert os.listdir(cwds[1]) == []  # rank 0 (node 0) writes the logs and the summary


def rows(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _report(rank, node, save, seen=True, load=None, failure=None):
    return {"rank": rank, "node": str(node), "host": "h", "save": save, "sees_marker": seen, "failure": failure,
            "load": load}


def test_the_refusal_names_what_differs():
    """shared_checkpoint_problem's lines (the two-node run above shows the first one end to end)."""
    same = [_report(rank, rank // 2, "/s/ckpt", load="iter_0000002") for rank in range(4)]
    assert shared_checkpoint_problem("/s/ckpt", same) is None
    blind = [*same[:3], _report(3, 1, "/s/ckpt", seen=False, load="iter_0000002")]
    line = shared_checkpoint_problem("/s/ckpt", blind)
    assert line and line.startswith("--save /s/ckpt is not one directory shared by every rank: rank 3 (node 1 on host h) "
                           "does not see the file rank 0 wrote in /s/ckpt. "), line
    failed = [*same[:2], _report(2, 1, "/s/ckpt", seen=None, failure="PermissionError: Permission denied"),
              *same[3:]]
    assert shared_checkpoint_problem("/s/ckpt", failed) == (
        "--save /s/ckpt: rank 2 (node 1 on host h) cannot create it or write there (PermissionError: Permission "
        "denied); give a directory every rank can write")
    apart = [*same[:2], *(_report(rank, 1, "/s/ckpt", load=None) for rank in (2, 3))]
    line = shared_checkpoint_problem("/s/ckpt", apart)
    assert line and line.startswith("the ranks resolved --load to different checkpoints: rank 0 loads iter_0000002, ranks "
                           "2, 3 (node 1 on host h) nothing (a fresh start); "), line


def test_each_node_says_why_its_ranks_stopped(monkeypatch, capsys):
    """An ``error:`` line comes from global rank 0, and from the first rank of every other node (a
    --load missing on node 1 only stops node 1's ranks at the flag checks: their log says why); a
    line rank 0 printed already (the shared-directory check) is not repeated."""
    from logra_megatron.errors import UserError, exit_on_user_error

    def fail(printed=False):
        error = UserError("no such checkpoint")
        error.printed = printed
        raise error

    said = {}
    for rank, local, node in ((0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("GROUP_RANK", str(node))
        for printed in (False, True):
            with pytest.raises(SystemExit) as stop:
                exit_on_user_error(fail)(printed)
            assert stop.value.code == 2
            said[rank, printed] = capsys.readouterr().err
    assert said[0, False] == said[2, False] == "error: no such checkpoint\n"
    assert said[1, False] == said[3, False] == "" and not any(said[rank, True] for rank in range(4))
