"""Named phases of a training step, for the profiler and for a phase timer.

``with phase("commit"): ...`` always opens a ``torch.profiler.record_function`` range (under a
running profiler the phase is a labelled range of its trace; otherwise it costs a few
microseconds). While a :class:`PhaseTimer` is active it also adds the phase's wall time to that
timer, synchronizing the device before and after on CUDA so the time is the phase's kernels',
not their launch. ``tools/benchmark_step_phases.py`` times a step this way; the optimizer, the
KL controller and the benchmark mark the phases.
"""

import time
from contextlib import contextmanager
from typing import Dict, Optional

import torch

_active: Optional["PhaseTimer"] = None


class PhaseTimer:
    """``with PhaseTimer(device) as timer: ...`` then ``timer.seconds`` (total wall time per
    phase name inside the block), ``timer.cpu_seconds`` (the process's CPU time in them, all
    threads: a figure a machine shared with other jobs disturbs less than wall time) and
    ``timer.calls`` (how often each ran). Phases may nest; a nested phase's time is also in its
    parent's, unless the parent is opened ``exclusive`` (then its figure is its own time only,
    so parts interleaved with each other, like the KL controller's probe forward passes and the
    divergences computed as each part's logits come out, stay disjoint)."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seconds: Dict[str, float] = {}
        self.cpu_seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self._outer: Optional[PhaseTimer] = None
        self._nested: list = []
        """Per open phase, innermost last: [wall, cpu] seconds of the phases closed inside it."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, name: str, seconds: float, cpu_seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu_seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def __enter__(self):
        global _active
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc):
        global _active
        _active = self._outer
        return False


@contextmanager
def phase(name: str, exclusive: bool = False):
    """Mark a phase of a step (module docstring); ``exclusive``: its time leaves out the phases
    nested in it (:class:`PhaseTimer`)."""
    timer = _active
    with torch.profiler.record_function(name):
        if timer is None:
            yield
            return
        timer.sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        timer._nested.append([0.0, 0.0])
        try:
            yield
        finally:
            timer.sync()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            nested_wall, nested_cpu = timer._nested.pop()
            if timer._nested:  # tell the enclosing phase
                timer._nested[-1][0] += wall
                timer._nested[-1][1] += cpu
            if exclusive:
                wall, cpu = wall - nested_wall, cpu - nested_cpu
            timer.add(name, wall, cpu)
