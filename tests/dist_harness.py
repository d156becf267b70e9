"""Run a multi-rank worker script once under torchrun (gloo, CPU) and collect its results.

Start-up (importing megatron, forming groups) dominates multi-rank tests, so each test module
launches its worker once in a module-scoped fixture; the worker runs many checks and writes one
JSON file per rank; the module's tests then assert on those results, one test per check.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def process_children() -> dict:
    """``{parent pid: [child pids]}`` of every live process (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def descendants(root: int) -> list:
    """The pids of ``root``'s children, their children, ... (torchrun starts its ranks in
    sessions of their own, so a process group does not reach them)."""
    children = process_children()
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(worker: str, nproc: int, out_dir, args=(), timeout: int = 900) -> dict:
    """Run ``tests/workers/<worker>`` on ``nproc`` ranks; return ``{rank: results}``.

    Raises with the tail of the output if the launch fails as a whole.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO / "tests" / "workers" / worker), "--out", str(out_dir), *map(str, args),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise RuntimeError(f"worker {worker} failed with exit code {proc.returncode}:\n{tail}")
    results = {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(nproc)}
    timings = os.environ.get("LOGRA_CHECK_TIMES")
    if timings:  # a file that collects each launch's per-check seconds (rank 0's), one JSON line each
        with open(timings, "a") as out:
            out.write(json.dumps({"worker": worker, "seconds": results[0].get("_seconds", {})}) + "\n")
    return results


def result(results: dict, name: str, rank: int = 0):
    """One check's value; fails the calling test with the worker's traceback if it raised."""
    value = results[rank].get(name)
    if value is None:
        raise AssertionError(f"check {name!r} did not run on rank {rank}")
    if isinstance(value, dict) and "error" in value:
        raise AssertionError(f"check {name!r} raised on rank {rank}:\n{value['error']}")
    return value
