"""logra_megatron/parallel.py: re-initializing one rank's layout in-process (as most tests do)
keeps its process groups, so no gloo threads pile up, and still reseeds."""

import os

import torch

from logra_megatron import parallel


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_reinitializing_one_rank_keeps_its_groups_and_reseeds():
    parallel.initialize(1, 1)
    group = parallel.tp_group()
    before = _threads()
    for seed in (11, 12, 13, 14, 15):
        parallel.initialize(1, 1, seed=seed)
        assert torch.initial_seed() == seed
    assert parallel.tp_group() is group
    assert _threads() == before  # each fresh set of groups was ~50 gloo threads that never end
