"""Preemption: a signal ends the run at a step boundary, with a checkpoint, instead of at once.

SLURM (``scancel``, the time limit, ``--signal=USR1@<seconds>``), Kubernetes and torchrun send
SIGTERM or SIGUSR1 to a job some time before they kill it. While :class:`ExitSignalHandler` is
installed (the trainer's default; ``--no-exit-signal-handler`` leaves the signals' default
action, death, in place), such a signal only records itself: the step in flight finishes, the
trainer saves an iteration (with ``--save``) and exits 0 with a line saying so, as Megatron's
``--exit-signal-handler`` does (``--exit-signal`` chooses the signals). Repeated signals are
ignored; Ctrl-C (SIGINT, not among the defaults) still interrupts, and SIGKILL cannot be caught.

Under torchrun every rank gets the signal, but not at the same instant: :meth:`stop_requested`
reduces a flag over all ranks at each step boundary, so every rank stops after the same step
(the reduction runs on the process's device: NCCL reduces device tensors only). torchrun's agent
passes SIGTERM on to its workers and kills them 30 s later; it passes SIGUSR1 on only when
``TORCHELASTIC_SIGNALS_TO_HANDLE`` names it.

torchrun also sends SIGTERM to the surviving ranks when one rank dies. Those cannot reach a step
boundary: with gloo their collective fails, and a run that fails after a signal gets the signal
again on the way out (the process ends as it would have without the handler); a rank blocked
in an NCCL collective runs no Python until the collective returns, so, as under Megatron's
handler, it ends with torchrun's SIGKILL.
"""

import os
import signal
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from logra_megatron.platform import default_device


class ExitSignalHandler:
    """A context manager: installs the handler for ``signal_names`` (on the main thread; elsewhere
    Python cannot, and the signals keep their action) and restores the previous handlers on
    exit. Disabled, it installs nothing and :meth:`stop_requested` is always None."""

    def __init__(self, signal_names: Sequence[str], enabled: bool = True):
        self.signals = [signal.Signals[name] for name in signal_names]
        self.enabled = enabled
        self.received: Optional[signal.Signals] = None
        """The first signal this process received (None: none)."""
        self._previous: dict = {}

    def __enter__(self) -> "ExitSignalHandler":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, exc_type, *_exc_info) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        installed, self._previous = self._previous, {}
        if exc_type is not None and self.received is not None and installed:
            # The run failed after a signal asked it to stop (a peer rank died and torchrun is
            # stopping the others): the signal takes its course now, as without the handler,
            # instead of leaving this rank to clean up process groups that can no longer answer.
            os.kill(os.getpid(), self.received)

    def _handle(self, number, _frame) -> None:
        if self.received is not None:
            return
        self.received = signal.Signals(number)
        if os.environ.get("RANK", "0") == "0":  # one line per job, at once (a write is safe in a handler)
            os.write(2, f"received {self.received.name}: finishing the RL step in flight, then saving and "
                        f"exiting\n".encode())

    def stop_requested(self) -> Optional[str]:
        """The name of the signal any rank received (the highest number when they differ), or
        None: the same answer on every rank. A collective over all ranks when enabled: every
        rank calls it at the same step boundary."""
        if not self.enabled:
            return None
        number = float(self.received or 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([number], dtype=torch.float64, device=default_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            number = float(flag.item())
        return signal.Signals(int(number)).name if number else None
