"""Calling rewards safely: :class:`RewardRunner` runs a reward function in worker processes
with a timeout, so a reward that raises, hangs (even in C code holding the GIL) or kills its
process scores 0.0 for that completion, is counted (:meth:`RewardRunner.take_failures`) and the
run goes on. A thread could not be stopped; a hung worker is killed and replaced on the next
call, so there are never more than ``workers`` of them. Workers are forked from the trainer
(they inherit the registered rewards and must not touch CUDA).
"""

import collections
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time

from logra_megatron.errors import UserError
from logra_megatron.platform.parent_death import die_with_parent
from logra_megatron.rl.rewards import RewardFn

FAILURE_KINDS = ("timeout", "error", "worker died", "invalid score")
"""Why a :class:`RewardRunner` gave a completion 0.0: the reward ran past ``timeout_s``, raised,
took its worker process down (``os._exit``, a crash), or returned something that is not a
finite number."""


class RewardRunner:
    """Score completions with ``reward_fn`` in worker processes, with a timeout per completion.

    A reward that raises, runs past ``timeout_s``, kills its process or returns a non-finite
    score gives that completion 0.0; the failure is counted by kind (:data:`FAILURE_KINDS`) and
    described in :attr:`recent_failures`, and the run goes on.

    Why processes, not threads: a thread cannot be stopped, and a hung reward in C code that
    holds the GIL (a catastrophic regular expression, ``int`` of a huge string, a big power)
    would even keep the trainer from noticing the timeout. A worker is a forked child (so any
    callable works, closures included, without pickling it); on a timeout it is killed with
    SIGKILL and replaced on the next call, so at most ``workers`` processes ever exist and hung
    ones never pile up. A sandboxed program a killed worker was running dies with it
    (parent-death signal). Records, texts and scores cross a pipe (picklable, small).

    Use it where a reward function is used (``runner(record, text) -> float``), or score a batch
    in parallel with :meth:`score_batch`; log :meth:`take_failures` once per step. Workers are
    started on first use and stopped by :meth:`close` (or ``with RewardRunner(...) as runner``).
    ``start_method`` other than ``"fork"`` needs a picklable ``reward_fn``.
    """

    def __init__(self, reward_fn: RewardFn, timeout_s: float = 30.0, workers: int = 1,
                 start_method: str = "fork", recent: int = 20):
        if not callable(reward_fn):
            raise UserError(f"RewardRunner: reward_fn must be callable, got {type(reward_fn).__name__}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise UserError(f"RewardRunner: timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(workers, int) or workers < 1:
            raise UserError(f"RewardRunner: workers must be a positive integer, got {workers!r}")
        if start_method not in multiprocessing.get_all_start_methods():
            raise UserError(f"RewardRunner: start_method must be one of "
                            f"{', '.join(multiprocessing.get_all_start_methods())}, got {start_method!r}")
        self.reward_fn, self.timeout_s = reward_fn, float(timeout_s)
        self._context = multiprocessing.get_context(start_method)
        self._workers = [None] * workers  # (process, connection) or None until needed
        self.failures = collections.Counter()
        """Failures by kind since the runner was made."""
        self._unreported = collections.Counter()
        self.recent_failures = collections.deque(maxlen=recent)
        """The last ``recent`` failures, one line each (kind, prompt, detail)."""
        self.scored = 0

    # -- scoring ---------------------------------------------------------------------------------

    def __call__(self, prompt_record: dict, completion_text: str) -> float:
        return self.score(prompt_record, completion_text)[0]

    def score(self, prompt_record: dict, completion_text: str):
        """``(score, None)``, or ``(0.0, failure description)`` when the reward misbehaved."""
        return self.score_batch([prompt_record], [completion_text], details=True)[0]

    def score_batch(self, prompt_records: list, completion_texts: list, details: bool = False) -> list:
        """Scores of ``completion_texts[i]`` for ``prompt_records[i]``, over all workers at once.

        With ``details=True`` each item is ``(score, failure description or None)``.
        """
        if len(prompt_records) != len(completion_texts):
            raise UserError(f"RewardRunner.score_batch: {len(prompt_records)} prompt records for "
                            f"{len(completion_texts)} completions")
        results = [None] * len(completion_texts)
        pending = collections.deque(range(len(completion_texts)))
        busy = {}  # worker slot -> (item index, deadline)
        while pending or busy:
            for slot in range(len(self._workers)):
                if pending and slot not in busy:
                    index = pending.popleft()
                    if self._send(slot, (prompt_records[index], completion_texts[index])):
                        busy[slot] = (index, time.monotonic() + self.timeout_s)
                    else:
                        results[index] = self._failed("worker died", prompt_records[index], "could not start")
            if not busy:
                continue
            connections = {self._workers[slot][1]: slot for slot in busy}
            wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            ready = multiprocessing.connection.wait(list(connections), timeout=wait)
            for connection in ready:
                slot = connections[connection]
                index, _ = busy.pop(slot)
                results[index] = self._receive(slot, prompt_records[index])
            now = time.monotonic()
            for slot, (index, deadline) in list(busy.items()):
                if now >= deadline and self._workers[slot][1] not in ready:
                    busy.pop(slot)
                    self._stop(slot)
                    results[index] = self._failed("timeout", prompt_records[index], f"after {self.timeout_s:g}s")
        self.scored += len(results)
        return results if details else [score for score, _ in results]

    def _send(self, slot: int, item) -> bool:
        for _ in range(2):  # a worker that died since its last item is replaced once
            if self._workers[slot] is None:
                self._workers[slot] = self._start_worker()
            try:
                self._workers[slot][1].send(item)
                return True
            except (OSError, EOFError):
                self._stop(slot)
        return False

    def _receive(self, slot: int, prompt_record: dict):
        process, connection = self._workers[slot]
        try:
            kind, value = connection.recv()
        except (EOFError, OSError):
            process.join(1.0)
            self._stop(slot)
            return self._failed("worker died", prompt_record, f"exit code {process.exitcode}")
        if kind == "error":
            return self._failed("error", prompt_record, value)
        if not math.isfinite(value):
            return self._failed("invalid score", prompt_record, repr(value))
        return value, None

    def _failed(self, kind: str, prompt_record: dict, detail: str):
        self.failures[kind] += 1
        self._unreported[kind] += 1
        prompt = str(prompt_record.get("prompt", ""))[:60] if isinstance(prompt_record, dict) else "?"
        description = f"{kind}: {detail} (prompt {prompt!r})"
        self.recent_failures.append(description)
        return 0.0, description

    # -- reporting -------------------------------------------------------------------------------

    def take_failures(self) -> dict:
        """Failures since the last call, for the step's metrics: ``reward_failures`` (all kinds) and
        ``reward_timeouts``, ``reward_errors``, ``reward_worker_deaths``, ``reward_invalid``."""
        counts = self._unreported
        self._unreported = collections.Counter()
        return {"reward_failures": float(sum(counts.values())),
                "reward_timeouts": float(counts["timeout"]), "reward_errors": float(counts["error"]),
                "reward_worker_deaths": float(counts["worker died"]),
                "reward_invalid": float(counts["invalid score"])}

    # -- workers ---------------------------------------------------------------------------------

    def _start_worker(self):
        ours, theirs = self._context.Pipe()
        # (A forkserver's workers are the server's children, not the trainer's.)
        parent = None if self._context.get_start_method() == "forkserver" else os.getpid()
        process = self._context.Process(target=_serve_rewards, args=(theirs, self.reward_fn, parent), daemon=True,
                                        name="reward-worker")
        process.start()
        theirs.close()
        return process, ours

    def _stop(self, slot: int) -> None:
        if self._workers[slot] is None:
            return
        process, connection = self._workers[slot]
        self._workers[slot] = None
        connection.close()
        if process.is_alive():
            process.kill()
        process.join(5.0)

    def close(self) -> None:
        """Stop the workers (a later call starts new ones)."""
        for slot in range(len(self._workers)):
            self._stop(slot)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


def _serve_rewards(connection, reward_fn: RewardFn, trainer_pid) -> None:
    """A worker's loop: score ``(record, text)`` items until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    # So is preemption (a signal to the whole process group): the trainer finishes the step in
    # flight, which may still need this worker (rl/preemption.py); the worker ends when the
    # trainer stops it or dies (below). A handler, not SIG_IGN, so programs a reward execs (the
    # sandbox) get the default action back.
    for number in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, _ignore)
    # A trainer killed with SIGKILL cannot stop its workers; the kernel can, so a worker busy in a
    # hung reward does not outlive it (elsewhere than Linux the closed pipe ends it when it next
    # waits).
    die_with_parent(trainer_pid)
    while True:
        try:
            prompt_record, completion_text = connection.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", float(reward_fn(prompt_record, completion_text)))
        except Exception as error:  # noqa: BLE001 -- any failure of the reward is the reply
            reply = ("error", f"{type(error).__name__}: {error}"[:300])
        connection.send(reply)


def _ignore(_number, _frame) -> None:
    pass
