"""Fault injection for the reliability tests: kill this process, or make a value NaN, at a
named point.

``LOGRA_MEGATRON_KILL_AT="<point>[:<n>][@<rank>]"`` makes the n-th (default first) arrival at
``kill_point("<point>")`` send SIGKILL to this process, as ``kill -9``, the OOM killer or a lost
node would: no handler, no flush, no clean-up. ``@<rank>`` limits it to one torchrun rank, and
it fires only in the first attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` 0), so a
restarted job runs through. ``LOGRA_MEGATRON_KILL_LOG=<file>`` appends ``<point> <unix time>``
just before the kill (how long the job took to end is measured from it).
``LOGRA_MEGATRON_KILL_SIGNAL=<name>`` (e.g. ``SIGTERM``) sends that signal instead of SIGKILL,
and the process goes on if it handles it (the preemption tests: a signal at a known point).
Points are named where their callers are (rl/checkpointing.py: the phases of a save;
rl/trainer.py: ``rl:step``, at the start of an RL step).
``LOGRA_MEGATRON_NAN_AT="<point>[:<n>]"`` makes ``nan_point("<point>", value)`` return NaN from
its n-th arrival on (rl/trainer.py: ``rl:loss``, the step's loss). Unset, a point costs one
dictionary lookup.
"""

import os
import signal
import time

KILL_AT_ENV = "LOGRA_MEGATRON_KILL_AT"
KILL_LOG_ENV = "LOGRA_MEGATRON_KILL_LOG"
KILL_SIGNAL_ENV = "LOGRA_MEGATRON_KILL_SIGNAL"
NAN_AT_ENV = "LOGRA_MEGATRON_NAN_AT"
_arrivals: dict = {}


def _parse(spec: str):
    """``point[:n][@rank]`` -> (point, n, rank or "")."""
    spec, _, rank = spec.partition("@")
    point, count = spec, 1
    head, _, tail = spec.rpartition(":")  # point names have colons themselves ("save:start")
    if tail.isdigit():
        point, count = head, int(tail)
    return point, count, rank


def nan_point(name: str, value: float) -> float:
    spec = os.environ.get(NAN_AT_ENV)
    if not spec:
        return value
    point, count, _ = _parse(spec)
    if point != name:
        return value
    _arrivals["nan:" + name] = _arrivals.get("nan:" + name, 0) + 1
    return float("nan") if _arrivals["nan:" + name] >= count else value


def kill_point(name: str) -> None:
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    point, count, rank = _parse(spec)
    if point != name or (rank and os.environ.get("RANK", "0") != rank):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    if _arrivals[name] == count:
        log = os.environ.get(KILL_LOG_ENV)
        if log:
            with open(log, "a") as handle:
                handle.write(f"{name} {time.time()}\n")
        os.kill(os.getpid(), signal.Signals[os.environ.get(KILL_SIGNAL_ENV) or "SIGKILL"])
