"""The smoke job end to end under torchrun, and bad input -> one clear line, no traceback."""

import os
import subprocess
import sys

import pytest
from dist_harness import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def run(args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=REPO)


@pytest.mark.parametrize("optimizer", ["adam", "logra"])
def test_smoke_job_trains_at_tp2(optimizer):
    proc = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "logra_megatron.smoke",
                "--tensor-model-parallel-size", "2", "--train-iters", "4", "--optimizer", optimizer])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 4
    assert losses[-1] < losses[0]
    assert f"tp=2 pp=1 dp=1 optimizer={optimizer}" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--tensor-model-parallel-size", "4"], "world size 1 is not divisible"),
    (["--preset", "nope"], "unknown model preset 'nope'"),
    (["--load", "/nonexistent/ckpt"], "checkpoint directory not found"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--micro-batch-size", "3"], "must be a multiple of micro batch size"),
    (["--seq-length", "1000"], "exceeds the model's max_seq"),
    (["--optimizer", "logra", "--logra-rank", "100"], "--logra-rank 100 is larger than the matrix"),
    (["--logra-refresh-interval", "-1"], "must be a positive number of steps"),
])
def test_bad_input_is_one_clear_line(args, message):
    proc = run(["-m", "logra_megatron.smoke", *args])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr
