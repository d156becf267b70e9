"""Child processes that die with the process that forked them.

A process killed with SIGKILL runs no cleanup, so whatever it forked lives on unless the kernel
ends it: Linux's ``PR_SET_PDEATHSIG`` sends a child a signal when its parent dies. Two kinds of
the trainer's children need it:

- reward workers (``rl/reward_runner.py``), which may be busy in a hung reward;
- the file writers Megatron's checkpoint saver forks, one per bucket
  (``dist_checkpointing/strategies/filesystem_async.py: write_preloaded_data_multiproc``). They
  report through multiprocessing queues and, their parent gone, block on those queues forever
  (CI: ``test_recovery`` found one alive 30 s after its trainer was killed mid-save).

Elsewhere than Linux there is no such call and these are no-ops.
"""

import contextlib
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up here, in the parent: a forked child of a multi-threaded process should not import or
# load libraries (a lock held by another thread at the fork stays held in the child).
_PRCTL = _find_prctl()

_guarded_parent = None
"""While :func:`forks_die_with_this_process` is active: this process's pid (read by its forks)."""


def die_with_parent(parent_pid) -> None:
    """Call first thing in a forked child: it is killed when its parent dies. A parent that died
    between the fork and this call sends no signal, so a child whose parent is no longer
    ``parent_pid`` exits at once (None: no such check, e.g. a forkserver's child)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


def _after_fork_in_child() -> None:
    global _guarded_parent
    parent, _guarded_parent = _guarded_parent, None  # (the child's own forks are not guarded)
    if parent is not None:
        die_with_parent(parent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forks_die_with_this_process():
    """Within this block, every process this one forks (e.g. by code we do not own, such as
    Megatron's checkpoint writers) is killed when this process dies."""
    global _guarded_parent
    previous, _guarded_parent = _guarded_parent, os.getpid()
    try:
        yield
    finally:
        _guarded_parent = previous
