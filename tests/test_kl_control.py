"""Predicted-KL step control in one process: it holds the realized KL near the target where the
uncontrolled step overshoots (also out of sample), the forecast scales quadratically for small
steps, the linear forecast agrees with the probe for small steps, forecasting never touches the
weights, and --kl-max-scale lets a small step grow; the budget follows --kl-target-schedule and a
resumed controller keeps its schedule."""

import dataclasses
import math

import pytest
import torch

from controller_doubles import count_probe_passes
from logra_megatron import parallel
from logra_megatron.errors import UserError
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController, ProbeSet, scheduled_kl_target
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
TOKENS = torch.randint(0, MODEL.vocab, (8, 33), generator=torch.Generator().manual_seed(0))
PROBE = ProbeSet(TOKENS[:2], torch.ones(2, 33), micro_batch_size=2)
HELD_OUT = ProbeSet(TOKENS[2:4], torch.ones(2, 33), micro_batch_size=2)  # rows the probe never sees
TARGET = 0.02


def controlled_run(mode, lr=5e-2, steps=5, kind="logra", held_out=None, mismatch=None, **settings):
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind=kind, lr=lr),
                                        LogRAConfig(rank=16, refresh_interval=5))
    # The realized KL of every step (the flag's default measures it every few steps).
    controller = PredictedKLController(KLControlConfig(mode=mode, target=TARGET, realized_interval=1, **settings))
    history = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 4)
        if mismatch is not None:  # what the trainer observes from the rollout engine each batch
            controller.observe_mismatch(mismatch)
        history.append({**controller.step(ddp, optimizer, PROBE, held_out), "budget": controller.budget()})
    return history


@pytest.mark.parametrize("kind", ["logra", "adam"])
def test_probe_control_holds_the_realized_kl_where_uncontrolled_overshoots(kind):
    uncontrolled = [m["kl_realized"] for m in controlled_run("off", kind=kind)]
    assert max(uncontrolled) > 5 * TARGET, uncontrolled
    controlled = controlled_run("probe", kind=kind)
    for metrics in controlled:
        assert metrics["kl_realized"] <= 1.2 * TARGET, controlled
        assert 0 < metrics["step_scale"] <= 1.0
    assert min(m["step_scale"] for m in controlled) < 0.5


@pytest.mark.parametrize("kind", ["logra", "adam"])
def test_forecast_is_calibrated_out_of_sample(kind):
    """On rows the probe did not see, the KL of the committed (scaled-down) step is within 2x of
    the target: the forecast generalizes beyond the rows it was fitted on."""
    controlled = controlled_run("probe", kind=kind, held_out=HELD_OUT)
    bound = [m for m in controlled if m["step_scale"] < 1.0]
    assert len(bound) >= 3, controlled
    for metrics in bound:
        assert TARGET / 2 <= metrics["kl_realized"] <= 2 * TARGET, controlled


def test_max_scale_lets_a_small_step_grow():
    grown = controlled_run("probe", lr=1e-4, steps=2, max_scale=3.0)
    assert all(1.0 < m["step_scale"] <= 3.0 for m in grown), grown
    assert all(m["kl_realized"] <= 1.2 * TARGET for m in grown), grown
    capped = controlled_run("probe", lr=1e-4, steps=2)
    assert all(m["step_scale"] == 1.0 for m in capped), capped


@pytest.fixture(scope="module")
def proposed_update():
    """A small proposed update D (low learning rate), previewable but not committed."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=1e-3),
                                        LogRAConfig(rank=16))
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, 4)
    before = [p.detach().clone() for p in ddp.parameters()]
    optimizer.propose()
    return ddp, controller, optimizer, before


def test_forecast_is_quadratic_in_the_step_for_small_steps(proposed_update):
    ddp, controller, optimizer, _ = proposed_update
    full = controller.kl(ddp, optimizer, PROBE, 1.0)
    assert full > 0
    for scale in (0.5, 0.25):
        scaled = controller.kl(ddp, optimizer, PROBE, scale)
        assert scaled == pytest.approx(scale**2 * full, rel=0.1)


def test_linear_forecast_agrees_with_the_probe_for_small_steps(proposed_update):
    ddp, controller, optimizer, _ = proposed_update
    probe = controller.kl(ddp, optimizer, PROBE, 1.0)
    linear = PredictedKLController(KLControlConfig(mode="linear", target=TARGET)).linear_kl(ddp, optimizer, PROBE)
    assert linear == pytest.approx(probe, rel=0.25)


def test_forecasts_leave_the_weights_bitwise_untouched(proposed_update):
    ddp, controller, optimizer, before = proposed_update
    controller.kl(ddp, optimizer, PROBE, 0.7)
    PredictedKLController(KLControlConfig(mode="linear")).linear_kl(ddp, optimizer, PROBE)
    assert all(torch.equal(p, b) for p, b in zip(ddp.parameters(), before))
    assert any(p.requires_grad for p in ddp.parameters())  # the dense remainder was previewed too


def test_bad_settings_are_clear():
    with pytest.raises(UserError, match="--kl-control must be one of off, probe, linear"):
        KLControlConfig(mode="always")
    with pytest.raises(UserError, match="--kl-target must be > 0"):
        KLControlConfig(target=0)
    with pytest.raises(UserError, match="--kl-probe-sequences"):
        KLControlConfig(probe_sequences=0)
    with pytest.raises(UserError, match="--kl-max-scale must be >= 1"):
        KLControlConfig(max_scale=0.5)


def test_demo_prints_the_documented_json():
    import json
    import os
    import subprocess
    import sys

    from dist_harness import REPO

    proc = subprocess.run([sys.executable, "tools/kl_control_demo.py", "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["kl_target"] == 0.02
    assert len(report["off"]["kl_realized"]) == 2
    for mode in ("probe", "linear"):
        assert set(report[mode]) >= {"kl_pred", "kl_realized", "step_scale"}
        assert all(value <= 1.2 * 0.02 for value in report["probe"]["kl_realized"])
    assert 0 < report["overhead_fraction"] < 1


@pytest.mark.parametrize("kind", ["logra", "adam"])
def test_a_non_finite_forecast_skips_the_step_and_the_next_one_commits(kind, monkeypatch):
    """A NaN KL forecast: nothing is committed (weights, masters and the step counter stay),
    the step reports failure; the next step, with a finite forecast, commits."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind=kind, lr=1e-2), LogRAConfig(rank=16))
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    finite_kl = PredictedKLController.kl

    def step(poisoned):
        monkeypatch.setattr(PredictedKLController, "kl",
                            (lambda *args: float("nan")) if poisoned else finite_kl)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 4)
        before = [p.detach().clone() for p in ddp.parameters()]
        result = controller.step(ddp, optimizer, PROBE)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(ddp.parameters(), before))
        return result, moved

    skipped, moved = step(poisoned=True)
    assert not skipped["success"] and skipped["step_scale"] == 0.0 and moved == 0.0
    committed, moved = step(poisoned=False)
    assert committed["success"] and moved > 0.0


def test_observed_mismatch_lowers_the_budget_to_at_most_half():
    controller = PredictedKLController(KLControlConfig(target=TARGET, subtract_mismatch=True))
    assert controller.budget() == TARGET  # nothing observed yet
    controller.observe_mismatch(0.2 * TARGET)
    assert controller.budget() == pytest.approx(0.8 * TARGET)  # the first observation seeds the EMA
    controller.observe_mismatch(0.7 * TARGET)
    assert controller.mismatch == pytest.approx((0.3 * 0.7 + 0.7 * 0.2) * TARGET)
    controller.observe_mismatch(float("nan"))  # ignored
    assert controller.budget() == pytest.approx((1 - 0.35) * TARGET)
    for _ in range(20):
        controller.observe_mismatch(5 * TARGET)
    assert controller.budget() == pytest.approx(0.5 * TARGET)  # floored
    resumed = PredictedKLController(KLControlConfig(target=TARGET, subtract_mismatch=True))
    resumed.load_state_dict(controller.state_dict())
    assert resumed.budget() == controller.budget() and resumed.mismatch == controller.mismatch
    # Without the flag an observation changes nothing.
    plain = PredictedKLController(KLControlConfig(target=TARGET))
    plain.observe_mismatch(0.5 * TARGET)
    assert plain.budget() == TARGET and plain.mismatch is None


def test_steps_hold_the_realized_kl_to_the_budget_left_by_the_mismatch():
    """An engine mismatch of 0.4 target: every controlled step keeps its realized KL near
    0.6 target (where without the flag it sits near the target)."""
    spent = controlled_run("probe", mismatch=0.4 * TARGET, subtract_mismatch=True)
    plain = controlled_run("probe", mismatch=0.4 * TARGET)
    for metrics in spent:
        assert metrics["budget"] == pytest.approx(0.6 * TARGET)
        assert metrics["kl_realized"] <= 1.2 * 0.6 * TARGET, spent
    assert max(m["kl_realized"] for m in plain) > 0.8 * TARGET, plain
    assert spent[0]["step_scale"] < plain[0]["step_scale"]  # the same first gradient, a smaller step


def test_the_budget_follows_its_schedule_step_by_step():
    """The reference implementation's setup: a cosine from 2e-4 to 2e-5 over 300 iterations, its
    endpoints the first and the last; the other shapes at a few iterations, by hand."""
    def budget_at(iteration, **settings):
        controller = PredictedKLController(KLControlConfig(**settings), train_iters=300)
        controller.set_iteration(iteration)
        return controller.budget()

    cosine = dict(target=2e-4, target_final=2e-5, target_schedule="cosine")
    assert budget_at(0, **cosine) == pytest.approx(2e-4, rel=1e-12)
    assert budget_at(299, **cosine) == pytest.approx(2e-5, rel=1e-12)
    assert budget_at(450, **cosine) == pytest.approx(2e-5, rel=1e-12)  # held after the schedule
    assert budget_at(149, **cosine) == pytest.approx(2e-5 + 0.5 * 1.8e-4 * (1 + math.cos(math.pi * 149 / 299)),
                                                     rel=1e-12)
    assert budget_at(149, **cosine) == pytest.approx(1.10473e-4, rel=1e-5)  # the same, computed by hand
    # --kl-target-decay-iters instead of --train-iters: 11 iterations, the midpoint at iteration 5.
    assert budget_at(5, target_decay_iters=11, **cosine) == pytest.approx(1.1e-4, rel=1e-12)
    linear = dict(target=2e-4, target_final=2e-5, target_schedule="linear", target_decay_iters=5)
    assert budget_at(3, **linear) == pytest.approx(2e-4 - 0.75 * 1.8e-4, rel=1e-12)  # 6.5e-5
    exponential = dict(target=2e-4, target_final=2e-5, target_schedule="exponential", target_decay_iters=3)
    assert budget_at(1, **exponential) == pytest.approx(math.sqrt(2e-4 * 2e-5), rel=1e-12)
    assert budget_at(123, target=2e-4) == 2e-4  # constant: the default
    # The mismatch is subtracted from the scheduled target and floored at half of it.
    controller = PredictedKLController(KLControlConfig(subtract_mismatch=True, **cosine), train_iters=300)
    controller.observe_mismatch(1.5e-5)
    controller.set_iteration(299)
    assert controller.budget() == pytest.approx(1e-5)  # max(2e-5 - 1.5e-5, 1e-5)
    controller.set_iteration(0)
    assert controller.budget() == pytest.approx(2e-4 - 1.5e-5)


def test_a_resumed_controller_keeps_its_schedule_or_says_how():
    config = KLControlConfig(target=2e-4, target_final=2e-5, target_schedule="cosine")
    saved = PredictedKLController(config, train_iters=300).state_dict()
    resumed = PredictedKLController(config, train_iters=300)
    resumed.load_state_dict(saved)
    resumed.set_iteration(77)
    assert resumed.budget() == pytest.approx(scheduled_kl_target("cosine", 2e-4, 2e-5, 77, 300))
    with pytest.raises(UserError, match=r"cosine 0.0002 -> 2e-05 over 300 iterations, this run's is cosine "
                                        r"0.0002 -> 2e-05 over 400 iterations: resume with"):
        PredictedKLController(config, train_iters=400).load_state_dict(saved)
    # ... unless --kl-target-decay-iters keeps the checkpoint's span.
    longer = dataclasses.replace(config, target_decay_iters=300)
    PredictedKLController(longer, train_iters=400).load_state_dict(saved)
    with pytest.raises(UserError, match="KL budget schedule is cosine"):
        PredictedKLController(KLControlConfig(target=2e-4), train_iters=300).load_state_dict(saved)
    # A constant budget may change on resume, as before (and a checkpoint without a schedule loads).
    constant = PredictedKLController(KLControlConfig(target=0.01), train_iters=10).state_dict()
    PredictedKLController(KLControlConfig(target=0.02), train_iters=20).load_state_dict(constant)
    PredictedKLController(config, train_iters=300).load_state_dict({"steps": 3, "mismatch": None})


def test_bad_schedules_are_clear():
    with pytest.raises(UserError, match="--kl-target-final and --kl-target-decay-iters need a --kl-target-schedule"):
        KLControlConfig(target_final=1e-3)
    with pytest.raises(UserError, match="--kl-target-schedule cosine needs --kl-target-final"):
        KLControlConfig(target_schedule="cosine")
    with pytest.raises(UserError, match="--kl-target-final must be > 0"):
        KLControlConfig(target_final=0.0, target_schedule="exponential")
    with pytest.raises(UserError, match="--kl-target-decay-iters must be >= 1"):
        KLControlConfig(target_final=1e-3, target_schedule="linear", target_decay_iters=0)


# Two probe parts (one row each) whose prompts do not count: the cached s = 0 logits keep only the
# masked positions.
PROMPT_MASKED = torch.ones(2, 33)
PROMPT_MASKED[:, :9] = 0
TWO_PART_PROBE = ProbeSet(TOKENS[:2], PROMPT_MASKED, micro_batch_size=1)


def counted_run(monkeypatch, cached: bool, held_out=None, steps=3):
    """``steps`` probe-controlled steps (the realized KL every step); per step the forward passes
    of the probe set (``ProbeSet.each_logits`` calls: each takes all of a probe's parts through
    the schedule together), the parts those passes computed, and the forecasts (``kl`` calls,
    the first and the refinements, less the realized KL's). ``cached=False`` is the controller
    as it was: the ``s = 0`` logits recomputed by every forecast."""
    calls = {"passes": 0, "parts": 0, "kl": 0}
    kl = PredictedKLController.kl

    def counting_kl(self, *args, **kwargs):
        calls["kl"] += 1
        return kl(self, *args, **kwargs)

    count_probe_passes(monkeypatch, calls)
    monkeypatch.setattr(PredictedKLController, "kl", counting_kl)
    if not cached:
        monkeypatch.setattr(PredictedKLController, "base_logits", lambda *args: None)
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                        LogRAConfig(rank=16, refresh_interval=5))
    controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=1))
    history = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, TOKENS, 4)
        calls.update(passes=0, parts=0, kl=0)
        metrics = controller.step(ddp, optimizer, TWO_PART_PROBE, held_out)
        history.append({**metrics, "passes": calls["passes"], "parts": calls["parts"], "forecasts": calls["kl"] - 1})
    state = [p.detach().clone() for p in ddp.parameters()]
    monkeypatch.undo()
    return history, state


@pytest.mark.parametrize("held_out", [None, HELD_OUT], ids=["realized_on_probe", "realized_held_out"])
def test_cached_base_logits_give_exactly_the_recomputed_forecast_with_fewer_passes(monkeypatch, held_out):
    """The s = 0 logits computed once per step: the same forecasts, scales, realized KL and
    weights, bit for bit, as recomputing them for every forecast; the probe's forward passes
    per step fall from 2 per forecast to 1 per forecast plus 1, each pass computing every part
    once."""
    recomputed, recomputed_state = counted_run(monkeypatch, cached=False, held_out=held_out)
    cached, cached_state = counted_run(monkeypatch, cached=True, held_out=held_out)
    parts = len(TWO_PART_PROBE.parts())
    assert parts == 2
    realized_parts = 2 * len(held_out.parts()) if held_out is not None else None
    assert any(m["forecasts"] > 1 for m in cached), cached  # the scale search refined
    for old, new in zip(recomputed, cached):
        for key in ("kl_pred", "step_scale", "kl_realized"):
            assert new[key] == old[key], (key, old, new)
        forecasts = new["forecasts"]
        assert forecasts == old["forecasts"]
        # Recomputed: 2 passes per forecast, and 2 of the realized KL's rows.
        assert old["passes"] == 2 * forecasts + 2
        assert old["parts"] == 2 * parts * forecasts + (realized_parts or 2 * parts)
        # Cached: 1 pass for s = 0, 1 per forecast; the realized KL on the probe reuses the cache
        # (1 pass), on held-out rows costs what it did (2).
        assert new["passes"] == 1 + forecasts + (2 if held_out is not None else 1)
        assert new["parts"] == parts * (1 + forecasts) + (realized_parts or parts)
        assert new["passes"] < old["passes"]
    assert all(torch.equal(a, b) for a, b in zip(cached_state, recomputed_state))


def test_the_growth_exponent_carries_to_the_next_step_and_saves_forecasts():
    """A step's first rescale uses the growth exponent the previous step measured (KL grows
    slower than s^2 this far from zero): over six steps started at s = 1 fewer re-forecasts than
    starting every step from the quadratic guess, with the realized KL still within the tolerance of the target;
    the exponent travels with the controller's checkpoint state."""
    def run(carry: bool):
        parallel.initialize(1, 1, seed=1234)
        _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=5e-2),
                                            LogRAConfig(rank=16, refresh_interval=5))
        controller = PredictedKLController(KLControlConfig(mode="probe", target=TARGET, realized_interval=0))
        forecasts, realized = 0, []
        kl = controller.kl

        def counting_kl(*args, **kwargs):
            nonlocal forecasts
            forecasts += 1
            return kl(*args, **kwargs)

        controller.kl = counting_kl
        for _ in range(6):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            lm_forward_backward(ddp, TOKENS, 4)
            if not carry:
                controller.growth_exponent = 2.0
            # Each step from s = 1 (no warm start), so its first rescale is the exponent's work.
            controller.settled_scale = controller.settled_length = None
            metrics = controller.step(ddp, optimizer, PROBE)
            realized.append(kl(ddp, optimizer, PROBE, metrics["step_scale"]))  # not counted
        return forecasts, realized, controller

    fresh, fresh_realized, _ = run(carry=False)
    carried, carried_realized, controller = run(carry=True)
    assert carried < fresh, (carried, fresh)
    tolerance = KLControlConfig().tolerance
    assert max(carried_realized) <= tolerance * TARGET * (1 + 1e-6), carried_realized
    assert 1.0 <= controller.growth_exponent < 2.0
    resumed = PredictedKLController(KLControlConfig(mode="probe", target=TARGET))
    resumed.load_state_dict(controller.state_dict())
    assert resumed.growth_exponent == controller.growth_exponent
