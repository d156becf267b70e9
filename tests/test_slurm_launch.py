"""launch/slurm_multi_node.sh under stand-ins for Slurm's srun and scontrol: run as sbatch runs
it (a copy of the script in Slurm's spool directory, the job started from the repository), it
finds the repository from SLURM_SUBMIT_DIR, and every argument reaches torchrun as it was given
(one with a space, one holding JSON)."""

import json
import os
import shutil
import stat
import subprocess

from dist_harness import REPO

SRUN = """#!/usr/bin/env bash
# srun's stand-in: one node (node 0 of 1), the options dropped, the command run here.
while [[ "${1:-}" == --* ]]; do shift; done
SLURM_NNODES=1 SLURM_NODEID=0 exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
echo node-a; echo node-b
"""
# The Python the script runs: records its working directory and arguments (and answers the
# launch line's version question).
PYTHON = """#!/usr/bin/env python3
import json, os, sys
if sys.argv[1:2] == ["-c"]:
    print("Python 3.fake"); sys.exit(0)
with open(os.environ["RECORD"], "w") as handle:
    json.dump({"cwd": os.getcwd(), "argv": sys.argv[1:]}, handle)
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_slurm_script_finds_the_repository_and_keeps_every_argument(tmp_path):
    bin_dir, spool = tmp_path / "bin", tmp_path / "spool"
    bin_dir.mkdir(), spool.mkdir()
    _executable(bin_dir / "srun", SRUN)
    _executable(bin_dir / "scontrol", SCONTROL)
    _executable(bin_dir / "python-stub", PYTHON)
    script = spool / "slurm_script"  # what sbatch runs: a copy, far from the repository
    shutil.copy(REPO / "launch" / "slurm_multi_node.sh", script)
    record = tmp_path / "record.json"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(REPO),
               SLURM_JOB_NODELIST="node-[a-b]", GPUS_PER_NODE="2", PYTHON=str(bin_dir / "python-stub"),
               RECORD=str(record))
    env.pop("LOGRA_ROOT", None)
    arguments = ["--run-name", "two words", "--config-json", '{"a": [1, 2], "b": "x y"}']
    proc = subprocess.run(["bash", str(script), "logra_megatron.train", *arguments], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(record.read_text())
    assert os.path.realpath(seen["cwd"]) == os.path.realpath(REPO)
    assert seen["argv"] == ["-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node",
                            "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29500", "-m",
                            "logra_megatron.train", *arguments]


def test_without_the_repository_it_says_so_in_one_line(tmp_path):
    script = tmp_path / "slurm_script"
    shutil.copy(REPO / "launch" / "slurm_multi_node.sh", script)
    env = dict(os.environ, SLURM_SUBMIT_DIR=str(tmp_path))
    env.pop("LOGRA_ROOT", None)
    proc = subprocess.run(["bash", str(script), "logra_megatron.train"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: cannot find the logra_megatron repository")
    assert len(proc.stderr.strip().splitlines()) == 1
