"""Both optimizers are Megatron-Core optimizers: the registry matches the flag's choices; each built
optimizer is a ``MegatronOptimizer`` (a ``ChainedOptimizer``) and offers everything Megatron-LM's
``train_step`` and checkpointing call; LoGRA's one global norm and one clip are the dense and
sketch norms combined, computed here independently; state_bytes reports every component; an
update rule registry entry is a complete rule."""

import copy
import math

import pytest
import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from logra_megatron import parallel
from logra_megatron.logra import UPDATE_RULES, LogRAConfig, LogRAOptimizer
from logra_megatron.logra.update_rules import UpdateRule
from logra_megatron.models import get_preset
from logra_megatron.optim.controlled import ControlledOptimizer
from logra_megatron.training import config as training_config
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.optimizer import STATE_BYTES_KEYS
from logra_megatron.training.setup import build_trainable, train_step

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (2, 17), generator=torch.Generator().manual_seed(0))


def _build(kind, clip_grad=1.0):
    parallel.initialize(1, 1, seed=1234)
    settings = training_config.OptimizerSettings(kind=kind, lr=1e-3, clip_grad=clip_grad)
    return build_trainable(MODEL, settings, LogRAConfig(rank=8))


def test_the_registry_says_which_optimizers_step_from_sketches():
    assert list(training_config.OPTIMIZERS) == ["adam", "logra"]
    assert [training_config.OptimizerSettings(kind=kind).sketched for kind in ("adam", "logra")] == [False, True]


@pytest.mark.parametrize("kind", ["adam", "logra"])
def test_built_optimizer_is_a_megatron_optimizer(kind):
    _, ddp, optimizer = _build(kind)
    assert isinstance(optimizer, MegatronOptimizer) and isinstance(optimizer, ChainedOptimizer)
    assert isinstance(optimizer, ControlledOptimizer)
    assert isinstance(optimizer, LogRAOptimizer) == (kind == "logra")

    # What Megatron-LM's train_step calls, in its order.
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    assert float(optimizer.get_loss_scale()) == 1.0
    loss = torch.tensor(2.0)
    assert float(optimizer.scale_loss(loss)) == 2.0
    lm_forward_backward(ddp, TOKENS, 2)
    update_successful, grad_norm, num_zeros = optimizer.step()
    assert update_successful is True and grad_norm > 0 and num_zeros is None
    scheduler.step(increment=1)
    assert all(group["lr"] == pytest.approx(5e-4) for group in optimizer.param_groups)
    if kind == "logra":  # the sketch space has its own group, driven like the dense ones
        assert sum(1 for group in optimizer.param_groups if group.get("logra_sketch")) == 1
    assert optimizer.get_parameters()  # the dense parameters (the sketched weights take no .grad)
    assert optimizer.count_zeros() >= 0

    sizes = optimizer.state_bytes()
    assert set(sizes) == set(STATE_BYTES_KEYS)
    assert sizes["grad_bytes"] > 0 and sizes["optimizer_state_bytes"] > 0
    assert sizes["master_weight_bytes"] == 0  # fp32 parameters: no master copies
    assert (sizes["projection_bytes"] > 0) == (kind == "logra")

    optimizer.set_lr(0.125)
    assert all(group["lr"] == 0.125 for group in optimizer.param_groups)


@pytest.mark.parametrize("kind", ["adam", "logra"])
def test_state_dict_round_trip_continues_identically(kind):
    """Megatron's per-rank ``state_dict`` / ``load_state_dict``: a copy of the optimizer loaded
    from it takes the next step exactly as the original does."""
    steps = lambda ddp, opt: train_step(ddp, opt, lambda m: lm_forward_backward(m, TOKENS, 2))  # noqa: E731
    model_a, ddp_a, opt_a = _build(kind)
    for _ in range(3):
        steps(ddp_a, opt_a)
    model_b, ddp_b, opt_b = _build(kind)
    model_b.load_state_dict(model_a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch's Adam would share the moments
    opt_b.reload_model_params()
    if kind == "logra":  # the projections travel with the state
        for name, projection in opt_a.projections().items():
            assert torch.equal(projection, opt_b.projections()[name])
    steps(ddp_a, opt_a)
    steps(ddp_b, opt_b)
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


def test_logra_one_norm_and_one_clip():
    """The chain's norm is sqrt(dense^2 + sketch^2), each computed here from the model's main
    grads and the sketch buffer; a clip below it scales both parts by max_norm / norm."""
    model, ddp, optimizer = _build("logra", clip_grad=1e-3)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, 2)
    dense_grads = {name: param.main_grad.clone() for name, param in model.named_parameters()
                   if param.requires_grad}
    sketch = optimizer.sketch_buffer.flat.clone()
    dense_sq = sum(float(g.double().pow(2).sum()) for g in dense_grads.values())
    expected = math.sqrt(dense_sq + float(sketch.double().pow(2).sum()))
    assert dense_sq > 0 and float(sketch.abs().sum()) > 0

    success, grad_norm, _ = optimizer.propose()
    # The clipping norm adds the probes' estimate of the gradient outside the sketch.
    residual_sq = optimizer.sketch.last_norms["residual_sq"]
    assert residual_sq > 0
    assert success and grad_norm == pytest.approx(math.sqrt(expected ** 2 + residual_sq), rel=1e-6)
    assert optimizer.diagnostics()["grad_norm_sketch"] == pytest.approx(expected, rel=1e-6)
    coefficient = 1e-3 / (grad_norm + 1e-6)
    assert coefficient < 1.0
    torch.testing.assert_close(optimizer.sketch.grads, sketch * coefficient, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        if param.requires_grad:  # fp32 params: Megatron's main grad is the param's grad, clipped in place
            torch.testing.assert_close(param.grad, dense_grads[name] * coefficient, rtol=1e-6, atol=0)
    optimizer.commit(1.0)


def test_update_rules_implement_the_interface():
    assert "adam" in UPDATE_RULES
    members = {name for name in dir(UpdateRule) if not name.startswith("_")} | {"state_names"}
    for rule in UPDATE_RULES.values():
        for name in members:
            assert hasattr(rule, name), (rule, name)
