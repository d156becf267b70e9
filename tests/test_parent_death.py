"""Children forked inside ``forks_die_with_this_process`` die with their parent when it is killed
with SIGKILL (as Megatron's checkpoint writers must: platform/parent_death.py); children forked
outside it live on, which is what the guard is for."""

import os
import signal
import subprocess
import sys
import time

import pytest

from logra_megatron.platform import parent_death

pytestmark = pytest.mark.skipif(parent_death._PRCTL is None, reason="PR_SET_PDEATHSIG is Linux's")

# The parent forks a child the way Megatron's writer does (a multiprocessing "fork" Process), the
# child blocks forever, the parent prints the child's pid and waits to be killed.
PARENT = """
import multiprocessing, sys, time
from logra_megatron.platform.parent_death import forks_die_with_this_process

def block():
    time.sleep(600)

guarded = sys.argv[1] == "guarded"
child = multiprocessing.get_context("fork").Process(target=block)
if guarded:
    with forks_die_with_this_process():
        child.start()
else:
    child.start()
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _child_after_killing_its_parent(mode: str) -> bool:
    """Whether the forked child is still alive 10 s after its parent was killed."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait(30)
        deadline = time.time() + 10.0
        while _alive(child) and time.time() < deadline:
            time.sleep(0.05)
        return _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_guarded_fork_dies_with_its_killed_parent():
    assert not _child_after_killing_its_parent("guarded")


def test_an_unguarded_fork_outlives_its_killed_parent():
    assert _child_after_killing_its_parent("unguarded")


def test_a_fork_whose_parent_died_before_the_guard_was_armed_exits():
    """The signal is armed in the child after the fork; a parent that died in between sends none,
    so the child checks who its parent is."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover -- the child
        os.close(read)
        parent_death.die_with_parent(os.getppid() + 10**6)  # not our parent: as if it had died
        os.write(write, b"lived")
        os._exit(3)
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.read(read, 16) == b"" and os.waitstatus_to_exitcode(status) == 0
    os.close(read)


def test_the_guard_ends_with_its_block_and_does_not_pass_to_grandchildren():
    with parent_death.forks_die_with_this_process():
        assert parent_death._guarded_parent == os.getpid()
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover -- the child: its own forks are not guarded by it
            os.write(write, b"none" if parent_death._guarded_parent is None else b"kept")
            os._exit(0)
        os.waitpid(child, 0)
        os.close(write)
        assert os.read(read, 16) == b"none"
        os.close(read)
    assert parent_death._guarded_parent is None
