"""The controller's cost per step (docs/KL_CONTROL.md, "What a controlled step costs"):

- a warm-start forecast that misses the tolerance band but whose rescale along the growth
  exponent stays within the tolerance of the budget for any exponent in [1, 2] is accepted:
  one forecast (one forward pass of the probe per part) where it took two, the committed KL
  still within the tolerance, ``kl_pred`` reported as a rescaled forecast
  (``kl_pred_forecast_scale``);
- the preview's fp32 round trip over cache-sized chunks on the CPU gives the same bits as
  one piece, so every forecast is today's forecast exactly (fp32 and bf16, on ``tiny``);
- the warm start aims at the last committed step's length: a step whose proposed update is
  shorter (Adam's second step after its sign step) is one forecast, not two or three;
- a search that ends below the band is carried up towards the budget, never past the tolerance.
"""

import math

import pytest
import torch
from controller_doubles import NoLogits, Proposal, SizedProposal

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.logra import sketch as sketch_module
from logra_megatron.models import get_preset
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import EXPONENT_SPREAD, PredictedKLController, ProbeSet
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
    """``rescalable`` against the worst case over a grid of exponents in ``[e - EXPONENT_SPREAD, 2]``
    (never below 1) around the carried ``e``; at the carried exponent 2 it accepts what lies
    within tolerance^8 of the budget on either side (the true exponent at worst 1.75), and no
    further."""
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
            for exponent in torch.linspace(max(1.0, carried - EXPONENT_SPREAD), 2, 11).tolist():
                true_kl = kl * (scale / at) ** exponent
                assert true_kl <= tolerance * TARGET * (1 + 1e-9), (carried, factor, exponent)
                assert true_kl >= TARGET / tolerance * (1 - 1e-9) or scale >= 1.0, (carried, factor, exponent)
    assert accepted > 0
    controller.growth_exponent = 2.0
    for factor, expected in ((tolerance**8 * 0.999, True), (tolerance**8 * 1.001, False),
                             (tolerance**-8 * 1.001, True), (tolerance**-8 * 0.999, False)):
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


def test_the_warm_start_keeps_the_step_length_so_a_shorter_update_is_one_forecast():
    """KL(s D) = c (s ||D||)^2 with ||D|| falling 1 -> 0.6 -> 0.55 (Adam's sign step, then
    shorter ones): from the second step on each step is one forecast (one call of ``kl``),
    the first made where ``s ||D||`` is the last committed step's length, and the committed
    KL on the budget. At the settled scale alone the second step forecasts 0.36 of the budget
    and searches again."""
    norms, strength = [1.0, 0.6, 0.55, 0.55], 10 * TARGET
    for use_length in (True, False):
        controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=0))
        optimizer = SizedProposal(norms) if use_length else Proposal()  # Proposal: no length said
        counts = []
        for step, norm in enumerate(norms):
            calls = []

            def synthetic_kl(model, optimizer, probe, scale, base=None, norm=norm):
                calls.append(scale)
                return strength * (scale * norm) ** 2

            controller.kl = synthetic_kl
            metrics = controller.step(None, optimizer, None, step_logits=NoLogits())
            assert strength * (metrics["step_scale"] * norm) ** 2 == pytest.approx(TARGET, rel=0.1)
            counts.append(len(calls))
        if use_length:
            assert counts[1:] == [1, 1, 1], counts
            assert controller.settled_length == pytest.approx(metrics["step_scale"] * norms[-1])
            resumed = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
            resumed.load_state_dict(controller.state_dict())
            assert resumed.settled_length == controller.settled_length
        else:
            assert counts[1] > 1, counts


def test_a_search_that_ends_below_the_band_is_carried_up_within_the_tolerance():
    """The first forecast at s = 1 is 10x the budget, the refinement at the rescaled step lands
    at half of it: the step commits a larger scale, its KL within the tolerance of the budget
    even if it grew as s^2 from there, ``kl_pred`` the refinement carried along the exponent."""
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=0))
    tolerance, forecasts = controller.config.tolerance, []

    def programmed_kl(model, optimizer, probe, scale, base=None):
        forecasts.append(scale)
        return 10 * TARGET if len(forecasts) == 1 else 0.5 * TARGET

    controller.kl = programmed_kl
    metrics = controller.step(None, Proposal(), None, step_logits=NoLogits())
    refined = forecasts[-1]
    assert len(forecasts) == 2 and metrics["kl_pred_forecast_scale"] == refined
    assert metrics["step_scale"] > refined
    assert 0.5 * TARGET * (metrics["step_scale"] / refined) ** 2 <= tolerance * TARGET * (1 + 1e-12)
    assert metrics["kl_pred"] == pytest.approx(controller._grown(0.5 * TARGET, refined, metrics["step_scale"]))
    assert controller.settled_scale == metrics["step_scale"]


@pytest.mark.parametrize("embeddings,orthonormal", [(False, True), (True, True), (False, False)],
                         ids=["dense_embeddings", "sketched_embeddings", "scaled_projections"])
def test_the_proposed_step_norm_is_the_committed_change_of_the_weights(embeddings, orthonormal):
    """``proposed_step_norm()`` (the sketched weights' ``lr ||U||`` for orthonormal projections,
    else ``lr U Q^T`` through the projection's Gram matrix; the dense remainder's ``after -
    before``) equals the norm of what ``commit(1.0)`` changes in the fp32 weights (no weight
    decay)."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                        LogRAConfig(rank=16, refresh_interval=5, embeddings=embeddings))
    if not orthonormal:  # (a new tensor, as a refresh makes: sketch and commit both use it)
        for entry in optimizer.weights:
            entry.sketch.projection = entry.sketch.projection * 1.5
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, 4)
    optimizer.propose()
    norm = optimizer.proposed_step_norm()
    optimizer.preview(0.0)  # the dense parts stepped in place: back to W, as the controller leaves it
    before = [p.detach().double().clone() for p in ddp.parameters()]
    optimizer.commit(1.0)
    moved = math.sqrt(sum(float(((p.detach().double() - b) ** 2).sum()) for p, b in zip(ddp.parameters(), before)))
    assert moved > 0
    assert norm == pytest.approx(moved, rel=1e-5)
    assert optimizer.proposed_step_norm() is None  # nothing proposed
