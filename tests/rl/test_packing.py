"""Packed sequences (THD, ``cu_seqlens``) against the padded layout at TP1, in fp32.

The same left-padded rollouts go through the padded path (``[B, 1, S, S]`` mask, per-row rotary
positions) and the packed one (rows bin-packed into token-budget microbatches, one ``[1, t]``
sequence each, SDPA per segment, rotary positions restarting at each boundary): per-token
log-probs, the GRPO loss and its dense gradients, and LoGRA's sketches agree within 1e-5. The
batch has one long row and many short ones, a row of one token, and a budget that gives a
microbatch of exactly one sequence. Changing one packed row's tokens leaves the others' logits
unchanged. The bin packing uses every row once.
"""

import math

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.models.positions import pack_rows
from logra_megatron.rl.grpo import policy_loss_backward, sequence_logprobs
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rl.packing import default_token_budget, token_bins
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import packed_forward, padded_forward
from logra_megatron.training.setup import build_trainable
from workers.ragged_rollouts import ragged_rollouts as shared_ragged_rollouts

MODEL = get_preset("tiny")
TOL = 1e-5


def ragged_rollouts(prompt_lengths, response_lengths, seed=0):
    """Left-padded prompts, right-padded responses, as the engines lay them out."""
    return shared_ragged_rollouts(prompt_lengths, response_lengths, MODEL.vocab, seed)


# one long row, many short ones, a row of a single token (a 1-token prompt, no response)
PROMPTS = [3, 9, 2, 1, 4, 5, 2, 7, 3, 6]
RESPONSES = [40, 3, 2, 0, 5, 1, 4, 2, 6, 3]


@pytest.fixture(scope="module")
def rollouts():
    return ragged_rollouts(PROMPTS, RESPONSES)


def _real_positions(rollouts):
    """[B, S-1]: the positions that score a real token (a real token predicts a real one)."""
    return rollouts.attention_mask[:, :-1] & rollouts.attention_mask[:, 1:]


def _build(kind="adam", logra=None, seed=7):
    parallel.initialize(1, 1, seed=seed)
    return build_trainable(MODEL, OptimizerSettings(kind=kind, lr=1e-3), logra)


# --- bin packing --------------------------------------------------------------------------------

def test_token_bins_use_every_row_once_and_respect_the_budget():
    lengths = [43, 12, 4, 1, 9, 6, 6, 9, 9, 9, 50]
    for budget in (1, 10, 16, 50, 64, 1000):
        bins = token_bins(lengths, budget)
        assert sorted(row for rows in bins for row in rows) == list(range(len(lengths)))
        for rows in bins:
            assert len(rows) == 1 or sum(lengths[row] for row in rows) <= budget
    assert token_bins(lengths, 1000) == [list(range(len(lengths)))]
    assert token_bins([5, 5, 5], 10) == [[0, 1], [2]]
    assert default_token_budget(4, 33) == 132


def test_pack_rows_restarts_positions_and_marks_boundaries(rollouts):
    packed = pack_rows(rollouts.tokens, rollouts.attention_mask)
    lengths = rollouts.attention_mask.sum(1)
    assert packed.params.qkv_format == "thd"
    assert packed.params.cu_seqlens_q.tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    assert packed.params.max_seqlen_q == int(lengths.max())
    assert packed.tokens.shape == (1, int(lengths.sum()))
    starts = packed.params.cu_seqlens_q[:-1].long()
    assert packed.position_ids[0, starts].eq(0).all()
    assert torch.equal(packed.tokens[0], rollouts.tokens[rollouts.attention_mask])
    filled = pack_rows(rollouts.tokens, rollouts.attention_mask, pad_to=int(lengths.sum()) + 5)
    assert filled.tokens.shape[1] == int(lengths.sum()) + 5 and filled.params.cu_seqlens_q[-1] == filled.tokens.shape[1]


# --- the model ---------------------------------------------------------------------------------

def test_packed_logits_match_padded_and_never_cross_a_boundary(rollouts):
    _, ddp, _ = _build()
    with torch.no_grad():
        _logits_checks(ddp, rollouts)


def _logits_checks(ddp, rollouts):
    padded = padded_forward(ddp, rollouts.tokens, rollouts.attention_mask, rollouts.position_ids)
    packed_rows = pack_rows(rollouts.tokens, rollouts.attention_mask)
    packed = packed_forward(ddp, packed_rows)
    real = rollouts.attention_mask
    assert packed.shape[:2] == (1, int(real.sum()))
    assert (packed[0] - padded[real]).abs().max() < TOL
    # a single sequence packed alone, and a one-token row
    for row in (0, 3):
        alone = pack_rows(rollouts.tokens[row:row + 1], rollouts.attention_mask[row:row + 1])
        assert (packed_forward(ddp, alone)[0] - padded[row][real[row]]).abs().max() < TOL
    # change row 4's tokens: every other row's logits stay bit-for-bit the same
    changed = rollouts.tokens.clone()
    changed[4] = torch.where(real[4], (changed[4] + 17) % MODEL.vocab, changed[4])
    other = packed_forward(ddp, pack_rows(changed, real))
    own = packed_rows.rows == 4
    assert not torch.equal(other[0, own], packed[0, own])
    assert torch.equal(other[0, ~own], packed[0, ~own])


@pytest.mark.parametrize("budget", [0, 16, 64])  # 16: the 43-token row is a microbatch of its own
def test_packed_logprobs_match_padded(rollouts, budget):
    _, ddp, _ = _build()
    padded_lp, padded_ent = sequence_logprobs(ddp, rollouts, 3)
    packed_lp, packed_ent = sequence_logprobs(ddp, rollouts, 3, pack=True, max_tokens=budget)
    real = _real_positions(rollouts)
    assert (packed_lp - padded_lp)[real].abs().max() < TOL
    assert (packed_ent - padded_ent)[real].abs().max() < TOL
    assert packed_lp[~real].eq(0).all()


def _loss_and_grads(rollouts, pack, budget, mode, kind="adam", logra=None):
    model, ddp, optimizer = _build(kind, logra)
    old, _ = sequence_logprobs(ddp, rollouts, 3, pack=pack, max_tokens=budget)
    shift = 0.3 * torch.sin(torch.arange(old.numel(), dtype=old.dtype)).reshape(old.shape)
    ref = old - 0.1 * torch.cos(torch.arange(old.numel(), dtype=old.dtype)).reshape(old.shape)
    advantages = torch.randn(rollouts.num_sequences, generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = policy_loss_backward(ddp, rollouts, advantages, old + shift, 3,
                                   PolicyLossConfig(loss_agg_mode=mode, kl_coef=0.05), ref_logprobs=ref,
                                   pack=pack, max_tokens=budget)
    return metrics, model, ddp, optimizer


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_packed_loss_and_dense_gradients_match_padded(rollouts, mode):
    padded, _, ddp_a, _ = _loss_and_grads(rollouts, False, 0, mode)
    grads_a = torch.cat([p.main_grad.detach().flatten().clone() for p in ddp_a.parameters()])
    packed, _, ddp_b, _ = _loss_and_grads(rollouts, True, 32, mode)
    grads_b = torch.cat([p.main_grad.detach().flatten().clone() for p in ddp_b.parameters()])
    assert abs(padded["loss"]) > 0 and grads_a.abs().max() > 0
    assert abs(packed["loss"] - padded["loss"]) < TOL * max(1.0, abs(padded["loss"]))
    assert (grads_b - grads_a).abs().max() < TOL * max(1.0, float(grads_a.abs().max()))


def test_packed_logra_sketches_match_padded(rollouts):
    runs = []
    for pack in (False, True):
        metrics, _, ddp, optimizer = _loss_and_grads(rollouts, pack, 24, "token-mean", kind="logra",
                                                     logra=LogRAConfig(rank=8))
        sketches = {entry.name: entry.sketch.sketch.detach().clone() for entry in optimizer.weights}
        dense = [p.main_grad.detach().flatten().clone() for p in ddp.parameters()
                 if getattr(p, "main_grad", None) is not None]
        runs.append((metrics["loss"], sketches, torch.cat(dense) if dense else torch.zeros(0)))
    (loss_a, sketches_a, dense_a), (loss_b, sketches_b, dense_b) = runs
    assert sketches_a and abs(loss_b - loss_a) < TOL * max(1.0, abs(loss_a))
    for name, sketch in sketches_a.items():
        scale = max(1.0, float(sketch.abs().max()))
        assert float(sketch.abs().max()) > 0, name
        assert (sketches_b[name] - sketch).abs().max() < TOL * scale, name
    if dense_a.numel():
        assert (dense_b - dense_a).abs().max() < TOL * max(1.0, float(dense_a.abs().max()))


# --- the KL controller's probe --------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 16])
def test_the_kl_probe_packed_forecasts_what_the_padded_one_does(rollouts, budget):
    """The controller's forecasts (probe mode with its cached s = 0 logits, a scaled refinement,
    the linear mode) on packed probe rows equal those on padded rows, computing only real tokens."""
    from logra_megatron.rl.grpo import probe_and_held_out
    from logra_megatron.training.config import KLControlConfig
    from logra_megatron.training.kl_control import PredictedKLController

    _, _, ddp, optimizer = _loss_and_grads(rollouts, True, 24, "token-mean", kind="logra", logra=LogRAConfig(rank=8))
    optimizer.propose()
    controller = PredictedKLController(KLControlConfig(mode="probe"))
    forecasts = []
    for pack in (False, True):
        probe, held_out = probe_and_held_out(rollouts, 6, 2, MODEL.vocab, pack=pack, max_tokens=budget)
        base = controller.base_logits(ddp, optimizer, probe)
        forecasts.append([controller.kl(ddp, optimizer, probe, 1.0, base), controller.kl(ddp, optimizer, probe, 0.3),
                          controller.kl(ddp, optimizer, held_out, 1.0), controller.linear_kl(ddp, optimizer, probe)])
        if pack:
            computed = sum(part.tokens.shape[1] for part, _ in probe.packed)
            assert computed == int(probe.attention_mask.sum()) < probe.tokens.numel()
            assert sum(float(mask.sum()) for _, mask in probe.packed) == float(probe.mask.sum()) > 0
    padded, packed = forecasts
    assert all(value > 0 for value in padded), padded
    # KL ~ 0.5 E[dz^2] for a logit change dz ~ sqrt(2 KL): logits that agree within TOL move it
    # by at most ~2 TOL sqrt(2 KL) (measured: 3e-8 at KL 2.8e-5, a 1e-3 share of it).
    for a, b in zip(padded, packed):
        assert abs(a - b) < 4 * TOL * math.sqrt(2 * a), (padded, packed)


# --- TP=2 and PP=2 (one 2-rank launch, tests/workers/packing_checks.py) ---------------------------

@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    from dist_harness import run_workers

    return run_workers("packing_checks.py", 2, tmp_path_factory.mktemp("packing"))


@pytest.mark.parametrize("kind", ["adam", "logra"])
@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_packed_matches_padded_at_tp2_and_pp2(parallel_results, layout, kind):
    from dist_harness import result

    for rank in (0, 1):
        check = result(parallel_results, f"{layout}/{kind}", rank)
        assert abs(check["loss"]) > 0 and check["logprob_scale"] > 0, check
        assert check["loss_diff"] < TOL * max(1.0, abs(check["loss"])), (rank, check)
        assert check["logprob_diff"] < TOL * max(1.0, check["logprob_scale"]), (rank, check)
        assert check["dense_diff"] < TOL * max(1.0, check["dense_scale"]), (rank, check)
        assert check["sketch_diff"] < TOL * max(1.0, check["sketch_scale"]), (rank, check)
        if kind == "logra":
            assert check["sketch_numel"] > 0 and check["sketch_scale"] > 0, (rank, check)
        else:
            assert check["dense_numel"] > 0 and check["dense_scale"] > 0, (rank, check)


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_the_packed_kl_probe_matches_padded_at_tp2_and_pp2(parallel_results, layout):
    from dist_harness import result

    for rank in (0, 1):
        check = result(parallel_results, f"{layout}/probe", rank)
        assert check["padded"] > 0, (rank, check)
        assert abs(check["packed"] - check["padded"]) < 4 * TOL * math.sqrt(2 * check["padded"]), (rank, check)


# --- the trainer's flags -----------------------------------------------------------------------

def test_packing_is_on_by_default_and_off_with_the_flag_or_the_unfused_backend():
    from logra_megatron.config import parse_train_args
    from logra_megatron.rl.trainer import packing_options

    assert packing_options(parse_train_args([], world_size=1)) == {"pack": True, "max_tokens": 0}
    assert packing_options(parse_train_args(["--no-pack-sequences"], world_size=1))["pack"] is False
    assert packing_options(parse_train_args(["--attention-backend", "unfused"], world_size=1))["pack"] is False
    assert packing_options(parse_train_args(["--max-tokens-per-microbatch", "512"], world_size=1)) == \
        {"pack": True, "max_tokens": 512}
