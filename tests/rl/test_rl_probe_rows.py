"""The KL controller's probe rows cover as many prompts as the probe has rows."""

import types

import torch

from logra_megatron.rl.grpo import probe_rows


def _rollouts(rows):
    return types.SimpleNamespace(tokens=torch.zeros(rows, 5, dtype=torch.long))


def test_probe_rows_take_one_sample_from_each_of_evenly_spaced_prompts():
    group = 8
    rows = probe_rows(_rollouts(16 * group), 8)
    assert rows.tolist() == [0, 16, 32, 48, 64, 80, 96, 112]
    assert len(set((rows // group).tolist())) == 8  # eight different prompts


def test_probe_rows_never_exceed_the_batch_and_stay_distinct():
    assert probe_rows(_rollouts(5), 8).tolist() == [0, 1, 2, 3, 4]
    rows = probe_rows(_rollouts(12), 5)
    assert len(set(rows.tolist())) == 5 and int(rows.max()) < 12
