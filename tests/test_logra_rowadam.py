"""``--logra-update rowadam``, the reference implementation's update rule (docs/ALGORITHM.md,
"RowAdam"): its update equals one computed in fp64 from the formulas of /work/shared/DESIGN.md
section 3b; the projection is a fresh Rademacher draw every step, the same on every rank; TP=2,
PP=2 and DP=2 give the TP=1 updates; its per-line state survives a TP=2 -> TP=1 checkpoint;
bf16 weights train in both master modes; its state is smaller than sketch-space Adam's; the KL
controller's cap defaults to 3; bad combinations are one error line. The multi-rank checks run
in one 2-rank launch (tests/workers/rowadam_checks.py)."""

import json
import math

import pytest
import torch
from dist_harness import result, run_workers

from logra_megatron import parallel
from logra_megatron.config import parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.rl.checkpointing import TRAINER_STATE_FILE, load_training_state
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
LR = 1e-3
B2, EPS, RELATIVE_STEP = 0.95, 1e-8, 6e-5  # DESIGN.md 3b; eps is --adam-eps (default)
TOLERANCE = 1e-5


# --- single process: the formulas ---------------------------------------------------------------

def reference_updates(sketches, projections, weights, sides, moments, t):
    """One RowAdam step over all weights, in fp64, straight from DESIGN.md 3b: per output row
    (here: per line the projection does not mix, rows of a right sketch ``S = G A^T``, columns
    of a left sketch ``S = A^T G``) ``v <- b2 v + (1 - b2) mean(S^2)``, a scale
    ``1 / (sqrt(v_hat) + eps)`` normalised to unit RMS, ``D`` = the scaled sketch rescaled to
    ``||S||``; the full-size updates ``D A`` together normalised to ``6e-5 x ||W||``."""
    updates = {}
    for name, sketch in sketches.items():
        right = sides[name] == "right"
        moments[name] = B2 * moments[name] + (1 - B2) * sketch.square().mean(dim=1 if right else 0)
        scale = 1.0 / ((moments[name] / (1 - B2**t)).sqrt() + EPS)
        scale = scale / scale.square().mean().sqrt()
        direction = sketch * (scale[:, None] if right else scale[None, :])
        direction = direction * sketch.norm() / direction.norm()
        updates[name] = direction @ projections[name].t() if right else projections[name] @ direction
    update_norm = math.sqrt(sum(float(u.square().sum()) for u in updates.values()))
    weight_norm = math.sqrt(sum(float(w.square().sum()) for w in weights.values()))
    return {name: u * (RELATIVE_STEP * weight_norm / update_norm) for name, u in updates.items()}


@pytest.fixture(scope="module")
def formula_run():
    """Three steps on different batches; per step the implementation's applied step
    ``lr x dW(U)`` and the fp64 reference's, and the projections each step used."""
    parallel.initialize(1, 1, seed=1234)
    _, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=LR, clip_grad=0.0),
                                        LogRAConfig(rank=8, update="rowadam"))
    moments = {entry.name: torch.zeros(entry.lines, dtype=torch.float64) for entry in optimizer.weights}
    steps = []
    for t in range(1, 4):
        tokens = torch.randint(0, MODEL.vocab, (4, 17), generator=torch.Generator().manual_seed(t))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, micro_batch_size=2)
        sketches = {e.name: e.sketch.sketch.double().clone() for e in optimizer.weights}
        projections = {e.name: e.sketch.projection.double().clone() for e in optimizer.weights}
        weights = {e.name: e.weight.detach().double().clone() for e in optimizer.weights}
        sides = {e.name: e.sketch.side for e in optimizer.weights}
        optimizer.propose()
        proposal = optimizer.proposal
        ours = {e.name: LR * _full_update(e, e.view(proposal.update)) for e in optimizer.weights}
        theirs = reference_updates(sketches, projections, weights, sides, moments, t)
        optimizer.commit(1.0)
        steps.append({"ours": ours, "theirs": theirs, "projections": projections, "weights": weights})
    return optimizer, steps


def _full_update(entry, update):
    """``dW(U)`` in fp64 (tiny weights: the dense product is fine in a test)."""
    projection, update = entry.sketch.projection.double(), update.double()
    return update @ projection.t() if entry.sketch.side == "right" else projection @ update


def test_update_equals_the_formulas_in_fp64(formula_run):
    _, steps = formula_run
    for step in steps:
        total = sum(float(u.square().sum()) for u in step["theirs"].values())
        weights = sum(float(w.square().sum()) for w in step["weights"].values())
        assert math.sqrt(total) == pytest.approx(RELATIVE_STEP * math.sqrt(weights), rel=1e-9)
        for name, theirs in step["theirs"].items():
            assert float(theirs.norm()) > 0, name
            error = float((step["ours"][name] - theirs).norm() / theirs.norm())
            assert error < 1e-6, (name, error)
    # Both sketch sides are covered: right (qkv, fc1) and left (proj, fc2).
    assert {e.sketch.side for e in formula_run[0].weights} == {"left", "right"}


def test_projection_is_a_fresh_rademacher_draw_every_step(formula_run):
    optimizer, steps = formula_run
    for name in steps[0]["projections"]:
        draws = [step["projections"][name] for step in steps]
        rank = draws[0].shape[1]
        for draw in draws:
            assert torch.allclose(draw.abs(), torch.full_like(draw, rank**-0.5), rtol=0, atol=1e-7), name
        assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2]), name
    assert optimizer.refreshes_done == 3 and optimizer.norm_estimator is None


def test_state_is_one_moment_per_line_and_the_kl_cap_is_three(formula_run):
    optimizer, _ = formula_run
    sketch_numel = sum(e.numel for e in optimizer.weights)
    lines = sum(e.lines for e in optimizer.weights)
    assert optimizer.update_rule.state()["line_exp_avg_sq"].numel() == lines < sketch_numel
    parallel.initialize(1, 1, seed=1234)
    _, _, adam = build_trainable(MODEL, OptimizerSettings(kind="logra", lr=LR), LogRAConfig(rank=8))
    def rule_bytes(opt):
        return sum(t.numel() * t.element_size() for t in opt.update_rule.state().values())

    assert rule_bytes(adam) == 4 * 2 * sketch_numel and rule_bytes(optimizer) == 4 * lines
    assert optimizer.state_bytes()["optimizer_state_bytes"] >= rule_bytes(optimizer)
    assert PredictedKLController(KLControlConfig()).max_scale(optimizer) == 3.0
    assert PredictedKLController(KLControlConfig()).max_scale(adam) == 1.0
    assert PredictedKLController(KLControlConfig(max_scale=1.5)).max_scale(optimizer) == 1.5


def test_bad_combinations_are_one_error_line(tmp_path):
    with pytest.raises(UserError, match="--use-distributed-optimizer") as error:
        parse_train_args(["--logra-update", "rowadam", "--use-distributed-optimizer"], world_size=2)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="identity"):
        LogRAConfig(update="rowadam", identity_projection=True)
    with pytest.raises(UserError, match="--logra-rowadam-step"):
        LogRAConfig(update="rowadam", rowadam_step=0.0)
    with pytest.raises(SystemExit):  # argparse: not a choice
        parse_train_args(["--logra-update", "sgd"], world_size=1)
    # A checkpoint of one rule does not load into the other (checked before any tensor is read).
    (tmp_path / TRAINER_STATE_FILE).write_text(json.dumps(
        {"step": 3, "checkpoint": {"optimizer": "logra", "logra_update": "adam"}}))
    with pytest.raises(UserError, match="--logra-update adam.*--logra-update rowadam"):
        load_training_state(str(tmp_path), None, None, {"optimizer": "logra", "logra_update": "rowadam"})
    config = parse_train_args(["--logra-update", "rowadam"], world_size=1)
    assert config.logra.update == "rowadam" and config.kl.max_scale is None


# --- two ranks: layouts, checkpoints, bf16 -------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("rowadam_checks.py", 2, tmp_path_factory.mktemp("rowadam"))


def test_reference_run_redraws_and_keeps_line_state(results):
    reference = result(results, "reference")
    assert reference["moved"] > 0.01 and reference["smallest_update"] > 1e-3
    assert reference["refreshes_done"] == 3
    assert all(reference["projections_are_signs"].values())
    assert set(reference["distinct_per_step"].values()) == {3}
    assert reference["line_state_nonzero"]


@pytest.mark.parametrize("check", ["tp2", "pp2", "dp2_split_batch"])
def test_layouts_give_the_tp1_updates(results, check):
    for rank in range(2):
        value = result(results, check, rank)
        assert value["smallest_update"] > 1e-3, value  # every sketched weight moved
        assert value["update_rel_err"] < 1e-4, value
        assert value["weight_rel_err"] < TOLERANCE, value
        assert value["projections_as_tp1"] and value["projections_same_on_all_ranks"], value


def test_checkpoint_at_tp2_resumes_at_tp1(results):
    value = result(results, "ckpt_tp2_resume_tp1")
    assert value["step_count"] == 2 and value["refreshes_done"] == 2 and value["line_state_nonzero"]
    assert value["step_rel_err"] < 1e-4, value
    assert value["weight_rel_err"] < TOLERANCE and value["vs_reference"] < TOLERANCE, value


@pytest.mark.parametrize("check,masters", [("bf16_fp32_masters", True), ("bf16_sr", False)])
def test_bf16_weights_train_in_both_master_modes(results, check, masters):
    for rank in range(2):
        value = result(results, check, rank)
        assert value["finite"] and value["replicas_identical"] and value["dp_size"] == 2, value
        assert value["smallest_update"] > 1e-3, value
        assert (value["master_bytes"] > 0) == masters, value
