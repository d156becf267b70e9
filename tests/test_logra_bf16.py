"""LoGRA in bf16: what each --logra-master mode keeps of small updates (the regime of RL
fine-tuning, lr 1e-6..1e-5), and the KL controller never overwrites fp32 masters with rounded
weights. Multi-rank bf16 checks (DP replicas bit-identical under stochastic rounding, masters
sharded over DP and resharded by checkpoints) are in tests/test_logra_parallel.py."""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (8, 33), generator=torch.Generator().manual_seed(0))
STEPS = 10
LR = 1e-5


def train(dtype, master, steps=STEPS, lr=LR, weight_decay=0.0):
    """The sketched weights before and after ``steps`` steps (fp32 masters when they exist)."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=lr, weight_decay=weight_decay),
                                        LogRAConfig(rank=0.5, master=master), dtype=dtype)
    before = {entry.name: entry.weight.detach().float().clone() for entry in optimizer.weights}
    changed_per_step = []
    for _ in range(steps):
        previous = {entry.name: entry.weight.detach().clone() for entry in optimizer.weights}
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 4)
        optimizer.step()
        changed = sum(int((entry.weight != previous[entry.name]).sum()) for entry in optimizer.weights)
        changed_per_step.append(changed / sum(t.numel() for t in previous.values()))
    source = optimizer.masters.masters if optimizer.masters.masters else \
        {entry.name: entry.weight for entry in optimizer.weights}
    after = {name: tensor.detach().float().clone() for name, tensor in source.items()}
    return before, after, changed_per_step


@pytest.fixture(scope="module")
def fp32_update():
    before, after, _ = train(torch.float32, "fp32")
    return {name: after[name] - before[name] for name in before}


@pytest.mark.parametrize("master,low,high", [("fp32", 0.9, 1.1), ("bf16-sr", 0.8, 1.2), ("none", 0.0, 0.5)])
def test_master_modes_keep_small_updates(fp32_update, master, low, high):
    """The share of the fp32 run's accumulated update (projection onto it) that the bf16 run
    carries after 10 steps at lr 1e-5: fp32 masters and unbiased stochastic rounding keep it,
    round-to-nearest without a master loses most of it."""
    before, after, changed = train(torch.bfloat16, master)
    reference = sum(float(d.square().sum()) for d in fp32_update.values())
    kept = sum(float(((after[n] - before[n]) * fp32_update[n]).sum()) for n in before) / reference
    assert low <= kept <= high, (master, kept)
    if master == "none":
        assert max(changed) < 0.15, changed  # most elements never move: their updates round away
    if master == "bf16-sr":
        assert min(changed) > 0.15, changed


def test_stochastic_rounding_keeps_updates_far_below_an_ulp():
    before_none, after_none, _ = train(torch.bfloat16, "none", steps=5, lr=1e-6)
    before_sr, after_sr, _ = train(torch.bfloat16, "bf16-sr", steps=5, lr=1e-6)
    moved_none = sum(float((after_none[n] - before_none[n]).abs().sum()) for n in before_none)
    moved_sr = sum(float((after_sr[n] - before_sr[n]).abs().sum()) for n in before_sr)
    assert moved_sr > 10 * moved_none, (moved_sr, moved_none)


def test_decoupled_weight_decay_reaches_bf16_weights_through_masters():
    """lr x wd = 1e-5: every step's decay is far below a bf16 ulp. Without a master no weight
    ever moves from it; an fp32 master accumulates it."""
    for master, moves in (("none", False), ("fp32", True)):
        before, after, _ = train(torch.bfloat16, master, steps=3, lr=1e-5, weight_decay=1.0)
        shrunk = sum(float(before[n].abs().sum() - after[n].abs().sum()) for n in before)
        total = sum(float(before[n].abs().sum()) for n in before)
        # 3 steps of (1 - 1e-5) decay shrink |W| by about 3e-5 of itself (gradients are tiny at
        # this lr, so the decay dominates the change of |W|).
        assert (shrunk / total > 1.5e-5) == moves, (master, shrunk / total)


def _controlled(target, steps=3):
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=LR), LogRAConfig(rank=0.5),
                                        dtype=torch.bfloat16)
    start = [m.clone() for m in optimizer._mains()]
    controller = PredictedKLController(KLControlConfig(mode="probe", target=target)) if target else None
    scales = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 4)
        if controller is None:
            optimizer.step()
        else:
            probe = ProbeSet(TOKENS[:2], torch.ones(2, 33), micro_batch_size=2)
            scales.append(controller.step(ddp, optimizer, probe)["step_scale"])
    return start, [m.clone() for m in optimizer._mains()], scales


def test_the_controller_never_overwrites_dense_fp32_masters():
    start, plain, _ = _controlled(target=None)
    moved = sum(int((a != b).sum()) for a, b in zip(start, plain))
    assert moved > 1000, moved
    _, controlled, scales = _controlled(target=10.0)  # never binds: the same steps as without it
    assert scales == [1.0, 1.0, 1.0]
    assert all(torch.equal(a, b) for a, b in zip(plain, controlled))
    _, scaled, scales = _controlled(target=1e-9)  # binds: the masters hold the scaled step in fp32
    assert max(scales) < 1.0
    rounded = sum(int((m != m.to(torch.bfloat16).float()).sum()) for m in scaled)
    assert rounded > 0.5 * moved, (rounded, moved)  # not read back from the bf16 weights
