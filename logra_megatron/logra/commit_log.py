"""The record of committed low-rank steps that a low-rank policy sync replays
(``--policy-sync lowrank``, logra_megatron/rollout/policy_update.py).

A committed step changed every sketched weight by ``W <- (1 - step wd) W - step dW(U)``, with
``dW(U) = U Q^T`` (right sketch) or ``P U`` (left), all under the projections of that moment.
A rollout engine that holds the weights of the last sync and the projections can follow the
trainer by applying the same steps, so the log keeps, per commit, the flat ``U`` (this rank's
shards, the size of the sketch), the step size and the weight decay, and whether the commit
was followed by a projection refresh (after which the old projections no longer apply and only
a full sync is right).

The log is bounded: past ``limit`` commits it drops what it holds and reports itself
incomplete (a long supervised warm-up between two syncs would otherwise keep one ``U`` per
step), and anything that sets the weights from outside a commit (a checkpoint load) marks it
incomplete too. An incomplete log means the next sync must be a full one.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Commit:
    update: torch.Tensor
    """The flat low-rank update ``U``, laid out like the sketch buffer (this rank's shards)."""
    step: float
    """``lr x scale`` of the commit."""
    weight_decay: float
    refresh: bool
    """The projections were refreshed after this commit."""


class CommitLog:
    """Commits since the last :meth:`take`, or None from :meth:`take` when some were lost."""

    def __init__(self, limit: int):
        self.limit = limit
        self.commits: List[Commit] = []
        self.complete = True

    def record(self, commit: Commit) -> None:
        if not self.complete:
            return
        if len(self.commits) >= self.limit:
            self.invalidate()
            return
        self.commits.append(commit)

    def invalidate(self) -> None:
        """Weights changed in a way the log cannot replay: the next sync must be full."""
        self.commits.clear()
        self.complete = False

    def take(self) -> Optional[List[Commit]]:
        """The commits since the last take (None when the log is incomplete), and start afresh."""
        commits = list(self.commits) if self.complete else None
        self.commits.clear()
        self.complete = True
        return commits
