"""Run a conversion tool on as many ranks as its TP x PP layout needs.

The tools are plain scripts: a user runs ``python tools/x.py ... --tensor-model-parallel-size 2``
and, when the layout needs more than one rank, the script starts itself again under torchrun
(``python -m torch.distributed.run --nproc-per-node T*P``) and exits with its status. Running
the script under torchrun directly also works (then the world size must be a multiple of T*P
and nothing is re-launched). Every check of the user's input runs before the re-launch, so a
bad flag or file ends in one line from the parent, never in torchrun's failure report.
"""

import os
import socket
import subprocess
import sys


def under_torchrun() -> bool:
    """True in a process that torchrun (or another launcher setting RANK) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size() -> int:
    """The launcher's world size, or 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def relaunch_if_needed(nproc: int) -> None:
    """Re-run this script (``sys.argv``) under torchrun on ``nproc`` local ranks and exit with
    its status, unless this process already is a rank or one rank suffices (then return)."""
    if under_torchrun() or nproc == 1:
        return
    env = dict(os.environ)
    # torchrun otherwise sets 1 and warns about it; share the cores between the ranks.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        status = subprocess.call(command, env=env)
    except KeyboardInterrupt:
        status = 130
    sys.exit(status)
