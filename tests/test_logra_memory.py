"""Memory of a LoGRA step, measured by tracking tensor allocations (platform/memory.py): applying
an update allocates a few sketches' worth, never a dense weight-sized temporary, and the KL
controller's forecast adds at most 2% of the weights' bytes beyond what its probe forwards need."""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra import masters
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.platform.memory import AllocationTracker, tensor_bytes
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
from logra_megatron.training.lm import forward_logits, lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (4, 17), generator=torch.Generator().manual_seed(0))


def proposed(dtype, master, rank=4, steps=2):
    """A LoGRA optimizer with a proposed (not committed) step after ``steps - 1`` plain ones
    (the first step is a refresh step, whose range finder is measured elsewhere)."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=1e-3, weight_decay=0.1),
                                        LogRAConfig(rank=rank, master=master, embeddings=True), dtype=dtype)
    for step in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 2)
        if step < steps - 1:
            optimizer.step()
    optimizer.propose()
    return ddp, optimizer


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                          (torch.bfloat16, "bf16-sr"), (torch.bfloat16, "none")])
def test_applying_an_update_allocates_no_dense_temporary(dtype, master, monkeypatch):
    _, optimizer = proposed(dtype, master)
    largest_sketch = max(entry.numel for entry in optimizer.weights) * 4
    largest_weight = max(entry.weight.numel() for entry in optimizer.weights) * 4
    assert largest_weight >= 16 * largest_sketch  # rank 4: the bound below separates the two
    bound = 3 * largest_sketch
    if master == "bf16-sr":
        # Stochastic rounding takes row blocks of a fixed element budget (ops/budgets.py:
        # SR_BLOCK_ELEMENTS, 1 Mi; fp32 values and three int64 temporaries, 28 bytes an element),
        # larger than any weight of tiny: here a 32nd of the largest weight, as at scale.
        budget = largest_weight // 4 // 32
        monkeypatch.setattr(masters, "SR_BLOCK_ELEMENTS", budget)
        bound = int(1.15 * budget * 28)
        assert bound <= largest_weight / 3
    with AllocationTracker() as track:
        optimizer.commit(1.0)
    assert track.peak_bytes <= bound, (track.peak_bytes, bound, largest_sketch)
    # What the tracker sees of the old way (the dense m x n product): a weight's worth.
    entry = max(optimizer.weights, key=lambda e: e.weight.numel())
    with AllocationTracker() as dense_way:
        entry.sketch.update_from(entry.view(torch.zeros(optimizer.sketch_buffer.numel)))
    assert dense_way.peak_bytes >= entry.weight.numel() * 4


def test_the_controller_holds_at_most_two_percent_of_the_weights():
    """What a controlled step keeps alive beyond a plain one, measured: the net allocation of
    an undoable proposal minus that of a final one (both allocate the low-rank update U), and
    nothing retained by the forecasts themselves."""
    ddp, optimizer = proposed(torch.float32, "fp32", steps=1)
    weight_bytes = tensor_bytes(ddp.parameters())
    optimizer.commit(1.0)

    def propose(undoable):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 2)
        with AllocationTracker() as track:
            optimizer.propose(undoable=undoable)
        return track

    final = propose(False)
    optimizer.commit(1.0)
    undoable = propose(True)
    held = undoable.net_bytes - final.net_bytes
    assert optimizer.extra_bytes() > 0 and abs(held - optimizer.extra_bytes()) <= 64  # (a scalar or two)
    assert held <= 0.02 * weight_bytes, (held, weight_bytes)

    probe = ProbeSet(TOKENS[:2], torch.ones(2, 17), micro_batch_size=1)
    controller = PredictedKLController(KLControlConfig(mode="probe", target=1e-6))
    with AllocationTracker() as forwards:  # two probe forwards of one row by themselves
        first = forward_logits(ddp, TOKENS[:1])
        second = forward_logits(ddp, TOKENS[1:2])
    del first, second
    with AllocationTracker() as forecast:
        kl = controller.kl(ddp, optimizer, probe, 1.0)
    assert kl > 0 and forecast.net_bytes <= 0, forecast.net_bytes
    # Transients only (side paths and the KL's per-token sums): the size of activations.
    assert forecast.peak_bytes <= 3 * forwards.peak_bytes, (forecast.peak_bytes, forwards.peak_bytes)
    optimizer.commit(controller._scale_for(kl))
