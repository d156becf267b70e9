"""KL control at a bounded cost (docs/KL_CONTROL.md): the probe's ``s = 0`` logits kept from the
step's own forward (``StepLogits``), no forward pass of the probe at ``s = 0``, and the warm start
(the first forecast at the scale the last step settled on, accepted when it lands in the band).

- kept logits equal the recomputed ones bit for bit where the step's forward grouped the probe
  rows as the probe does, and to fp32 rounding where it grouped them otherwise (other
  microbatches; the GRPO passes' packing, padded and packed probes);
- a controlled step costs one forward pass of the probe per forecast and none more: a count
  that fails if a forecast or a refinement recomputes ``s = 0``;
- the warm start: each step's first forecast at the previous step's scale; fewer forecasts
  than starting every step at ``s = 1``, the realized KL still within the tolerance of the
  target; the settled scale travels with the controller's checkpoint state.
"""

import math

import pytest
import torch
from controller_doubles import NoLogits, Proposal, count_probe_passes

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet, StepLogits
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (8, 33), generator=torch.Generator().manual_seed(0))
TARGET = 0.02
STEP_MICRO_BATCH = 4  # the step's forward: rows 0-3, then 4-7


def lm_probe(rows, micro_batch_size):
    """Batch rows ``rows`` as the step's forward sees them (its inputs ``TOKENS[:, :-1]``), the
    first 9 positions (a prompt) not counted."""
    rows = torch.tensor(rows)
    mask = torch.ones(len(rows), TOKENS.shape[1] - 1)
    mask[:, :9] = 0
    return ProbeSet(TOKENS[rows, :-1], mask, micro_batch_size=micro_batch_size, rows=rows)


def build(lr=5e-2, **settings):
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=lr),
                                        LogRAConfig(rank=16, refresh_interval=5))
    return ddp, optimizer, PredictedKLController(KLControlConfig(mode="probe", target=TARGET, **settings))


def forward_backward(ddp, optimizer, keep=None):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, STEP_MICRO_BATCH, keep_logits=keep)


@pytest.mark.parametrize("rows,micro_batch_size,exact", [
    ([0, 1, 2, 3], 4, True),   # the probe's part is the step's first microbatch: the same matmuls
    ([1, 5, 6], 2, False),     # parts that straddle the step's microbatches
    ([0, 1, 2, 3], 1, False),  # one row a part
], ids=["same_groups", "other_groups", "one_row_parts"])
def test_kept_logits_are_the_recomputed_ones(rows, micro_batch_size, exact):
    ddp, optimizer, controller = build()
    probe = lm_probe(rows, micro_batch_size)
    keep = controller.step_logits(probe)
    forward_backward(ddp, optimizer, keep)
    optimizer.propose()
    recomputed = controller.base_logits(ddp, optimizer, probe)
    kept = controller.base_logits(ddp, optimizer, probe, keep)
    assert len(kept) == len(recomputed) == len(probe.parts())
    for (values, keep_mask, shape), (ref_values, ref_mask, ref_shape) in zip(kept, recomputed):
        assert shape == ref_shape and torch.equal(keep_mask, ref_mask) and values.shape == ref_values.shape
        if exact:
            assert torch.equal(values, ref_values)
        else:  # fp32, other matmul shapes: rounding only
            torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    for scale in (1.0, 0.3):
        ours = controller.kl(ddp, optimizer, probe, scale, kept)
        today = controller.kl(ddp, optimizer, probe, scale, recomputed)
        assert ours > 0
        assert ours == today if exact else ours == pytest.approx(today, rel=1e-4)


def test_a_probe_that_is_not_in_the_step_forward_is_refused():
    ddp, optimizer, controller = build()
    wide = ProbeSet(TOKENS[:2], torch.ones(2, 33), rows=torch.arange(2))  # 33 columns, the forward has 32
    keep = StepLogits([wide])
    with pytest.raises(ValueError, match="not those of the step's batch"):
        forward_backward(ddp, optimizer, keep)
    with pytest.raises(ValueError, match="needs its batch rows"):
        StepLogits([ProbeSet(TOKENS[:2], torch.ones(2, 33))])


def counted_steps(monkeypatch, steps=4, kept=True, realized_interval=1, warm=True):
    """Controlled steps; per step the forward passes of the probe set (``ProbeSet.each_logits``
    calls, each all of its parts together) and the parts they computed, the forecasts (``kl``
    calls, less the realized KL's) and the scale of the first."""
    calls = {"passes": 0, "parts": 0, "kl": []}
    kl = PredictedKLController.kl

    def counting_kl(self, model, optimizer, probe, scale, base=None):
        calls["kl"].append(scale)
        return kl(self, model, optimizer, probe, scale, base)

    count_probe_passes(monkeypatch, calls)
    monkeypatch.setattr(PredictedKLController, "kl", counting_kl)
    ddp, optimizer, controller = build(realized_interval=realized_interval)
    probe = lm_probe([0, 1, 2, 3], 2)
    history = []
    for _ in range(steps):
        if not warm:
            controller.settled_scale = None
        keep = controller.step_logits(probe) if kept else None
        forward_backward(ddp, optimizer, keep)
        calls.update(passes=0, parts=0, kl=[])
        metrics = controller.step(ddp, optimizer, probe, step_logits=keep)
        forecasts = len(calls["kl"]) - (1 if metrics["kl_realized"] is not None else 0)
        history.append({**metrics, "passes": calls["passes"], "forwards": calls["parts"], "forecasts": forecasts,
                        "first_scale": calls["kl"][0], "length": controller.settled_length})
    state = [p.detach().clone() for p in ddp.parameters()]
    monkeypatch.undo()
    return history, state, controller


def test_a_controlled_step_costs_one_probe_pass_per_forecast(monkeypatch):
    """No forward pass of the probe at s = 0: with the logits kept from the step's forward, a
    step's passes are one per part per forecast (the first and every refinement) and one per
    part for the realized KL on the probe; the s = 0 pass the controller made itself (today's
    cache) is one more per part; and the two give the same steps to fp32 rounding."""
    kept, kept_state, _ = counted_steps(monkeypatch, kept=True)
    own, own_state, _ = counted_steps(monkeypatch, kept=False)
    parts = len(lm_probe([0, 1, 2, 3], 2).parts())
    assert any(m["forecasts"] > 1 for m in kept), kept  # a refinement ran (and recomputed nothing)
    for ours, today in zip(kept, own):
        assert ours["forwards"] == parts * (ours["forecasts"] + 1), ours
        assert today["forwards"] == parts * (today["forecasts"] + 2), today
        assert ours["passes"] == ours["forecasts"] + 1 and today["passes"] == today["forecasts"] + 2
        assert ours["forecasts"] == today["forecasts"]
        assert ours["step_scale"] == pytest.approx(today["step_scale"], rel=1e-4)
        assert ours["kl_realized"] == pytest.approx(today["kl_realized"], rel=1e-4)
    for a, b in zip(kept_state, own_state):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_kept_logits_give_today_s_steps_bit_for_bit_where_the_groups_agree(monkeypatch):
    """The probe grouped as the step's forward groups it (its first microbatch): every forecast,
    scale, realized KL and weight equal to the controller that computes s = 0 itself."""
    def run(kept):
        ddp, optimizer, controller = build(realized_interval=1)
        probe = lm_probe([0, 1, 2, 3], 4)
        history = []
        for _ in range(3):
            keep = controller.step_logits(probe) if kept else None
            forward_backward(ddp, optimizer, keep)
            history.append(controller.step(ddp, optimizer, probe, step_logits=keep))
        return history, [p.detach().clone() for p in ddp.parameters()]

    ours, our_state = run(True)
    today, today_state = run(False)
    for a, b in zip(ours, today):
        for key in ("kl_pred", "step_scale", "kl_realized"):
            assert a[key] == b[key], (key, a, b)
    assert all(torch.equal(a, b) for a, b in zip(our_state, today_state))


def test_the_first_forecast_starts_where_the_last_step_settled(monkeypatch):
    """Warm start on the model: after the first step (at s = 1) each step's first forecast is at
    the scale that gives its proposed step the length the previous step committed (LoGRA says
    its step's length: ``proposed_step_norm``); a step whose forecast there lands in the band is
    one forecast; the realized KL stays within the tolerance of the target; the settled scale
    travels with the controller's checkpoint state. (On ``tiny`` with this learning rate the
    scale a step needs swings 2-3x from step to step, so the warm start saves no forecast here:
    ``test_a_warm_start_in_the_band_is_one_forecast`` shows where it does.)"""
    warm, _, controller = counted_steps(monkeypatch, steps=6, realized_interval=1, warm=True)
    assert warm[0]["first_scale"] == 1.0
    for previous, step in zip(warm, warm[1:]):
        norm = step["length"] / step["step_scale"]  # this step's ||D||
        assert step["first_scale"] == pytest.approx(min(1.0, previous["length"] / norm), rel=1e-12)
        assert step["first_scale"] != previous["step_scale"]  # the length, not the scale
    for metrics in warm:
        if metrics["forecasts"] == 1:  # accepted in the band, re-centred on the budget
            assert metrics["step_scale"] == pytest.approx(metrics["first_scale"], rel=0.1)
            assert metrics["kl_pred"] == pytest.approx(TARGET)
    tolerance = KLControlConfig().tolerance
    assert max(m["kl_realized"] for m in warm) <= tolerance * TARGET * (1 + 1e-6), warm
    resumed = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    resumed.load_state_dict(controller.state_dict())
    assert resumed.settled_scale == controller.settled_scale == warm[-1]["step_scale"]
    assert resumed.settled_length == controller.settled_length == warm[-1]["length"]
    older = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    older.load_state_dict({"steps": 3, "mismatch": None})  # a checkpoint from before: s = 1 first
    assert older.settled_scale is None


def test_a_warm_start_in_the_band_is_one_forecast():
    """KL(s D) = c s^1.5 with c drifting 4% a step (a regime that holds from step to step): the
    first step searches from s = 1 (three forecasts); every later step's warm start lands in the
    band and is one forecast, where starting at s = 1 costs two (the carried growth exponent
    makes its first rescale exact) or more; both commit steps within the tolerance."""
    def run(warm):
        controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=0))
        optimizer, forecasts, steps = Proposal(), [], 6
        for step in range(steps):
            strength = 10 * TARGET * (1 + 0.04 * step)
            calls = []

            def synthetic_kl(model, optimizer, probe, scale, base=None):
                calls.append(scale)
                return strength * scale**1.5

            controller.kl = synthetic_kl
            if not warm:
                controller.settled_scale = None
            metrics = controller.step(None, optimizer, None, step_logits=NoLogits())
            realized = strength * metrics["step_scale"] ** 1.5
            assert realized <= controller.config.tolerance * TARGET
            if step:  # the exponent is measured (1.5): the forecast of the committed step is its KL
                assert metrics["kl_pred"] == pytest.approx(realized)
            forecasts.append(len(calls))
        return forecasts

    warm, cold = run(True), run(False)
    assert warm[0] == cold[0] == 3
    assert warm[1:] == [1] * 5, warm
    assert all(count >= 2 for count in cold[1:]), cold


def test_the_band():
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    tolerance = controller.config.tolerance
    assert controller.in_band(TARGET, 0.5, 1.0)
    assert controller.in_band(tolerance * TARGET, 0.5, 1.0)
    assert controller.in_band(TARGET / tolerance, 0.5, 1.0)
    assert not controller.in_band(TARGET / tolerance * (1 - 1e-9), 0.5, 1.0)  # too small: the step may grow
    assert controller.in_band(TARGET / 100, 1.0, 1.0)  # ... unless it is at the cap
    assert not controller.in_band(tolerance * TARGET * (1 + 1e-9), 1.0, 1.0)
    assert not math.isnan(controller._scale_for(TARGET / 4, 3.0, at=0.5))
    assert controller._scale_for(TARGET / 4, 3.0, at=0.5) == pytest.approx(1.0)  # KL ~ s^2 from s = 0.5


# --- the GRPO passes: padded and packed probes, kept from the policy loss's forward ----------------

@pytest.mark.parametrize("pack,budget", [(False, 0), (True, 24), (True, 0)],
                         ids=["padded", "packed_24", "packed_default"])
def test_grpo_forward_keeps_the_probe_and_held_out_logits(pack, budget):
    """The policy loss's forward (microbatches of 3 rows, or packed bins of ``budget`` tokens)
    keeps the probe's and the held-out rows' s = 0 logits; re-assembled into the probe's own
    parts (padded by 2 rows, or packed by its own bins) they are the recomputed ones to fp32
    rounding, and so are the forecasts."""
    from logra_megatron.rl.grpo import policy_loss_backward, probe_and_held_out, sequence_logprobs
    from logra_megatron.rl.losses import PolicyLossConfig
    from workers.ragged_rollouts import ragged_rollouts

    rollouts = ragged_rollouts([3, 9, 2, 1, 4, 5, 2, 7, 3, 6], [40, 3, 2, 0, 5, 1, 4, 2, 6, 3], MODEL.vocab)
    ddp, optimizer, controller = build(lr=1e-3, realized_interval=1)
    probe, held_out = probe_and_held_out(rollouts, 4, 2, MODEL.vocab, pack=pack, max_tokens=16)
    assert held_out is not None and probe.rows is not None
    keep = controller.step_logits(probe, held_out)
    old, _ = sequence_logprobs(ddp, rollouts, 3, pack=pack, max_tokens=budget)
    advantages = torch.randn(rollouts.num_sequences, generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    policy_loss_backward(ddp, rollouts, advantages, old, 3, PolicyLossConfig(), pack=pack, max_tokens=budget,
                         keep_logits=keep)
    optimizer.propose()
    for rows in (probe, held_out):
        recomputed = controller.base_logits(ddp, optimizer, rows)
        kept = keep.base(rows)
        for (values, mask, shape), (ref_values, ref_mask, ref_shape) in zip(kept, recomputed):
            assert shape == ref_shape and torch.equal(mask, ref_mask)
            torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
        ours, today = controller.kl(ddp, optimizer, rows, 1.0, kept), controller.kl(ddp, optimizer, rows, 1.0,
                                                                                      recomputed)
        assert ours > 0 and ours == pytest.approx(today, rel=1e-4)
    assert not keep.kept  # every kept row served once
