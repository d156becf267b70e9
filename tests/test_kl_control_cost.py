"""The controller's cost per step (docs/KL_CONTROL.md, "What a controlled step costs"):

- a warm-start forecast that misses the tolerance band but whose rescale along the growth
  exponent stays within the tolerance of the budget for any exponent in [1, 2] is accepted:
  one forecast (one forward pass of the probe per part) where it took two, the committed KL
  still within the tolerance, ``kl_pred`` reported as a rescaled forecast
  (``kl_pred_forecast_scale``);
- the preview's fp32 round trip over cache-sized chunks on the CPU gives the same bits as
  one piece, so every forecast is today's forecast exactly (fp32 and bf16, on ``tiny``).
"""

import math

import pytest
import torch
from controller_doubles import NoLogits, Proposal

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.logra import sketch as sketch_module
from logra_megatron.models import get_preset
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (8, 33), generator=torch.Generator().manual_seed(0))
TARGET = 0.02


@pytest.mark.parametrize("exponent", [1.5, 2.0])
def test_a_drifting_step_is_one_forecast_and_stays_within_the_tolerance(exponent):
    """KL(s D) = c s^e with c growing or shrinking 15% a step (past the band of 1.1 at the
    previous scale): after the first step each step is one forecast, the forecast at the
    previous step's scale carried to the committed one, and the committed step's KL within the
    tolerance of the target (the controller's exponent is measured on step 0). (At a carried
    exponent of 1 the guaranteed band is the tolerance band itself: the worst case, s^2, of a
    rescale along s^1 moves the KL by the square of the factor it corrects.)"""
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=0))
    tolerance = controller.config.tolerance
    optimizer, strength = Proposal(), 10 * TARGET
    for step in range(8):
        strength *= 1.15 if step % 4 < 2 else 1 / 1.15
        calls = []

        def synthetic_kl(model, optimizer, probe, scale, base=None):
            calls.append(scale)
            return strength * scale**exponent

        controller.kl = synthetic_kl
        previous = controller.settled_scale
        metrics = controller.step(None, optimizer, None, step_logits=NoLogits())
        realized = strength * metrics["step_scale"] ** exponent
        assert TARGET / tolerance <= realized <= tolerance * TARGET, (step, realized)
        if step:
            first = strength * previous**exponent
            assert not controller.in_band(first, previous, 1.0)  # today's band: a second forecast
            assert len(calls) == 1, (step, calls)
            assert metrics["kl_pred_forecast_scale"] == previous != metrics["step_scale"]
            assert metrics["kl_pred"] == pytest.approx(controller._grown(first, previous, metrics["step_scale"]))


def test_the_rescale_is_accepted_only_where_every_exponent_keeps_the_tolerance():
    """``rescalable`` against the worst case over a grid of exponents in [1, 2]; at the carried
    exponent 2 it accepts what lies within tolerance^2 of the budget, and no further."""
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    tolerance, accepted = controller.config.tolerance, 0
    for carried in (1.0, 1.3, 1.7, 2.0):
        controller.growth_exponent = carried
        for factor in torch.logspace(-1, 1, 81).tolist():
            kl, at = factor * TARGET, 0.4
            scale = controller._scale_for(kl, 1.0, at=at)
            if not controller.rescalable(kl, at, scale, 1.0):
                continue
            accepted += 1
            for exponent in torch.linspace(1, 2, 11).tolist():
                true_kl = kl * (scale / at) ** exponent
                assert true_kl <= tolerance * TARGET * (1 + 1e-9), (carried, factor, exponent)
                assert true_kl >= TARGET / tolerance * (1 - 1e-9) or scale >= 1.0, (carried, factor, exponent)
    assert accepted > 0
    controller.growth_exponent = 2.0
    for factor, expected in ((tolerance**2 * 0.999, True), (tolerance**2 * 1.001, False),
                             (tolerance**-2 * 1.001, True), (tolerance**-2 * 0.999, False)):
        kl = factor * TARGET
        assert controller.rescalable(kl, 0.4, controller._scale_for(kl, 1.0, at=0.4), 1.0) == expected, factor
    assert not controller.rescalable(0.0, 0.4, 1.0, 1.0)
    assert not controller.rescalable(math.inf, 0.4, 0.1, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_wd", "wd"])
def test_the_chunked_preview_is_the_one_piece_preview_bit_for_bit(monkeypatch, dtype, weight_decay):
    """The fp32 round trip of a previewed output over chunks (rows that do not divide evenly,
    a width wider than a chunk) equals the same arithmetic in one piece."""
    generator = torch.Generator().manual_seed(1)
    output = torch.randn(3, 37, 50, generator=generator).to(dtype)
    side = torch.randn(3, 37, 50, generator=generator).to(dtype)
    holder = sketch_module.LinearSketch.__new__(sketch_module.LinearSketch)
    holder._preview, holder._preview_factors = (0.37, weight_decay, None), None
    reference = output.to(torch.float32, copy=True)
    if weight_decay:
        reference.mul_(1.0 - 0.37 * weight_decay)
    reference = reference.sub_(side, alpha=0.37).to(dtype)
    for chunk in (1 << 15, 128, 7):  # one piece here (1850 elements), 2 rows a chunk, 1 row a chunk
        monkeypatch.setattr(sketch_module, "PREVIEW_CPU_CHUNK_ELEMENTS", chunk)
        result = holder._previewed(output, side)
        assert result.dtype == dtype and result.shape == output.shape
        assert result.data_ptr() != output.data_ptr()
        assert torch.equal(result, reference), chunk


def _proposed_step(prompt: int, dtype=torch.float32):
    """A LoGRA step on ``tiny`` proposed (not committed) under the probe-mode controller, its probe
    of 4 rows with the first ``prompt`` positions uncounted, and the probe's cached ``s = 0`` logits."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                        LogRAConfig(rank=16, refresh_interval=5), dtype=dtype)
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    mask = torch.ones(4, 32)
    mask[:, :prompt] = 0
    probe = ProbeSet(TOKENS[:4, :-1], mask, micro_batch_size=2)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, 4)
    optimizer.propose()
    return ddp, optimizer, controller, probe, controller.base_logits(ddp, optimizer, probe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forecasts_with_the_chunked_preview_are_today_s_exactly(monkeypatch, dtype):
    """On ``tiny``: the forecast at several scales with the preview chunked (a few rows a chunk)
    equals the forecast with it in one piece (today's), bit for bit."""
    ddp, optimizer, controller, probe, base = _proposed_step(prompt=9, dtype=dtype)
    forecasts = {}
    for chunk in (1 << 40, 64):  # one piece (today), then a few rows a chunk
        monkeypatch.setattr(sketch_module, "PREVIEW_CPU_CHUNK_ELEMENTS", chunk)
        forecasts[chunk] = [controller.kl(ddp, optimizer, probe, scale, base) for scale in (1.0, 0.3, 0.05)]
    assert all(value > 0 for value in forecasts[64])
    assert forecasts[64] == forecasts[1 << 40], forecasts


@pytest.mark.parametrize("prompt", [0, 9], ids=["every_position", "prompt_masked"])
def test_the_cached_forecast_is_the_recomputed_one_bit_for_bit(prompt):
    """The forecast from the ``s = 0`` logits cached once a step (every position counted: the
    cached rows are the logits themselves, no zero-filled copy) equals the forecast that
    recomputes them, at every scale."""
    ddp, optimizer, controller, probe, base = _proposed_step(prompt=prompt)
    for scale in (1.0, 0.3):
        cached = controller.kl(ddp, optimizer, probe, scale, base)
        assert cached > 0
        assert cached == controller.kl(ddp, optimizer, probe, scale)
