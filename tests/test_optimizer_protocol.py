"""Both optimizers satisfy the training optimizer protocol: the registry matches the flag's
choices, each built optimizer is a TrainingOptimizer, state_bytes reports every component,
set_lr reaches every param group, and an update rule registry entry is a complete rule."""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra import UPDATE_RULES, LogRAConfig, LogRAOptimizer
from logra_megatron.logra.update_rules import UpdateRule
from logra_megatron.models import get_preset
from logra_megatron.training import config as training_config
from logra_megatron.training.dense_optimizer import DenseOptimizer
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.optimizer import OPTIMIZERS, STATE_BYTES_KEYS, TrainingOptimizer
from logra_megatron.training.setup import build_trainable, train_step

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (2, 17), generator=torch.Generator().manual_seed(0))


def test_registry_names_are_the_flag_choices():
    assert set(OPTIMIZERS) == set(training_config.OPTIMIZERS)


@pytest.mark.parametrize("kind,cls", [("adam", DenseOptimizer), ("logra", LogRAOptimizer)])
def test_built_optimizer_satisfies_the_protocol(kind, cls):
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, training_config.OptimizerSettings(kind=kind, lr=1e-3),
                                        LogRAConfig(rank=8))
    assert isinstance(optimizer, cls)
    assert isinstance(optimizer, TrainingOptimizer)
    train_step(ddp, optimizer, lambda m: lm_forward_backward(m, TOKENS, 2))

    sizes = optimizer.state_bytes()
    assert set(sizes) == set(STATE_BYTES_KEYS)
    assert sizes["grad_bytes"] > 0 and sizes["optimizer_state_bytes"] > 0
    assert sizes["master_weight_bytes"] == 0  # fp32 parameters: no master copies
    assert (sizes["projection_bytes"] > 0) == (kind == "logra")

    optimizer.set_lr(0.125)
    groups = optimizer.param_groups
    assert groups and all(group["lr"] == 0.125 for group in groups)
    if kind == "logra":  # the sketch space has its own group, driven like the dense ones
        assert any(group.get("logra_sketch") for group in groups)


def test_update_rules_implement_the_interface():
    assert "adam" in UPDATE_RULES
    members = {name for name in dir(UpdateRule) if not name.startswith("_")} | {"state_names"}
    for rule in UPDATE_RULES.values():
        for name in members:
            assert hasattr(rule, name), (rule, name)
