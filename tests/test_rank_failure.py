"""A rank killed in a 4-rank torchrun job (TP=2 x DP=2): the job ends with a non-zero exit
within a bound (no rank hangs in a collective); launched through
launch/torchrun_single_node.sh with --max-restarts, it resumes from the latest complete
checkpoint by itself and finishes with every step's metrics exactly once."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from logra_megatron.faults import KILL_AT_ENV, KILL_LOG_ENV

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
RUN = ["--tensor-model-parallel-size", "2", "--warmup-iters", "3", "--max-operand", "4", "--train-iters",
       str(STEPS), "--eval-prompts", "8", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size",
       "4", "--kl-probe-sequences", "2", "--no-progress", "--save-interval", "1"]
END_BOUND_S = 60
"""How long the job may take to end after the kill: torchrun notices a dead worker within its
monitor interval and stops the others (measured here: a few seconds); the bound leaves room
for a loaded 2-core machine. Without torchrun, a rank waiting on a dead peer gives up after
the process-group timeout (10 minutes)."""


def launch(tmp_path, restarts, kill_rank=2, kill_step=3):
    log = tmp_path / "kill.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGRA_SKIP_SETUP="1",
               **{KILL_AT_ENV: f"rl:step:{kill_step}@{kill_rank}", KILL_LOG_ENV: str(log)})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # torchrun of this environment
    env["PYTHON"] = sys.executable  # (launch/python_env.sh: the test's interpreter runs the ranks)
    ckpt = str(tmp_path / "ckpt")
    command = ["bash", str(REPO / "launch" / "torchrun_single_node.sh")]
    if restarts:
        command += ["--max-restarts", str(restarts)]
    command += ["4", "logra_megatron.train", *RUN, "--save", ckpt, "--load", ckpt, "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    ended = time.time()
    killed_at = [float(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, killed_at, ended


def test_a_killed_rank_ends_the_job_within_the_bound(tmp_path):
    proc, killed_at, ended = launch(tmp_path, restarts=0)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(killed_at) == 1, (killed_at, proc.stderr[-3000:])
    assert ended - killed_at[0] < END_BOUND_S, ended - killed_at[0]


def test_max_restarts_resumes_from_the_latest_checkpoint_and_finishes(tmp_path):
    proc, killed_at, _ = launch(tmp_path, restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(killed_at) == 1  # the first attempt did die
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["phase"] == "rl"] == list(range(STEPS))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == STEPS and summary["tensor_model_parallel_size"] == 2
