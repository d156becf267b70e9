"""The memory planner on packed microbatches (issue 33 item 5): a packed plan's activations follow
the token budget (``--max-tokens-per-microbatch``), not ``micro_batch_size x seq_length``;
``--validate`` measures a packed step of tiny within its bounds; the trainer's start-up plan
(rl/memory_plan.py) takes the run's packing settings and its default budget."""

import dataclasses
import json
import os
import subprocess
import sys

from dist_harness import REPO
from logra_megatron.models.config import get_preset
from logra_megatron.planning.activations import activation_bytes, probe_layout
from logra_megatron.planning.settings import PlanSettings
from logra_megatron.planning.validate import COMPONENT_BOUND, PEAK_BOUND
from logra_megatron.rl.config import ModelSourceConfig, RunConfig, TrainConfig
from logra_megatron.rl.memory_plan import plan_settings, plan_summary
from logra_megatron.rl.packing import default_token_budget

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _packed(**changes) -> PlanSettings:
    base = PlanSettings(model=get_preset("tiny"), optimizer="adam", kl_control="off", micro_batch_size=2,
                        global_batch_size=8, seq_length=64, pack_sequences=True, max_tokens_per_microbatch=256)
    return dataclasses.replace(base, **changes)


def _saved(settings: PlanSettings) -> int:
    return activation_bytes(settings, 0, "cuda")["saved_activations_bytes"]


def test_packed_activations_follow_the_token_budget():
    one, two = _saved(_packed()), _saved(_packed(max_tokens_per_microbatch=512))
    # a layer's saved tensors are per token (SDPA keeps no t x t term); only the rope tables'
    # and logsumexp's small terms keep it from exactly 2
    assert 1.9 < two / one < 2.1, (one, two)


def test_packed_activations_do_not_follow_micro_batch_size_or_seq_length():
    packed = _packed()
    assert _saved(packed.with_changes(micro_batch_size=4)) == _saved(packed)
    assert _saved(packed.with_changes(seq_length=32)) == _saved(packed)
    # ... where the padded plan of the same flags does (its microbatch is b x s)
    padded = packed.with_changes(pack_sequences=False)
    assert _saved(padded.with_changes(micro_batch_size=4)) > 1.9 * _saved(padded)
    assert _saved(padded.with_changes(seq_length=32)) < 0.6 * _saved(padded)


def test_a_row_longer_than_the_budget_is_one_microbatch():
    # the trainer puts such a row alone in a microbatch: the plan's largest is the row
    assert _packed(max_tokens_per_microbatch=16).tokens_per_microbatch == 64
    assert _saved(_packed(max_tokens_per_microbatch=16)) == _saved(_packed(max_tokens_per_microbatch=64))


def test_packing_needs_sdpa_as_in_the_trainer():
    # the trainer pads under the unfused backend (rl/trainer.py packing_options); so does the plan
    unfused = _packed(attention_backend="unfused")
    assert not unfused.packed
    assert _saved(unfused) == _saved(unfused.with_changes(pack_sequences=False))


def test_validate_measures_a_packed_step_within_bounds():
    # one small case: tiny, LoGRA in bf16 under the KL probe, 2 microbatches of 128 tokens of
    # 32-token rows (4 rows each, micro_batch_size 2 would pad 2 x 32)
    proc = subprocess.run(
        [sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--validate", "--json", "--optimizer", "logra",
         "--bf16", "--logra-rank", "0.25", "--kl-probe-sequences", "2", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--seq-length", "32", "--max-tokens-per-microbatch", "128", "--steps", "1"],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    [record] = report["ranks"]
    assert record["packed"] and record["tokens_per_microbatch"] == 128
    for name, item in record["components"].items():
        assert abs(item["error"]) <= COMPONENT_BOUND, (name, item)
    peak, breakdown = record["peak_step"], record["plan_breakdown"]
    # the forward/backward on the packed rows is what the peak checks (not the optimizer's phase)
    assert breakdown["forward_backward_peak_bytes"] == peak["predicted"], breakdown
    assert abs(peak["error"]) <= PEAK_BOUND, (peak, breakdown)


def test_the_kl_probe_is_packed_as_the_trainer_packs_it():
    # 8 probe rows of 32 tokens: parts of as many whole rows as the budget holds (rl/grpo.py
    # probe_set), not --micro-batch-size rows padded; a row longer than the budget alone
    probe = _packed(kl_probe_sequences=8, seq_length=32, max_tokens_per_microbatch=128, kl_control="probe")
    assert probe_layout(probe) == (4, 2)
    assert probe_layout(probe.with_changes(max_tokens_per_microbatch=16)) == (1, 8)
    assert probe_layout(probe.with_changes(max_tokens_per_microbatch=64 * 32)) == (8, 1)
    # the default budget (micro_batch_size rows' worth) holds micro_batch_size rows, as the trainer's
    assert probe_layout(probe.with_changes(max_tokens_per_microbatch=default_token_budget(2, 32))) == (2, 4)
    assert probe_layout(probe.with_changes(pack_sequences=False)) == (2, 4)
    # its logits follow the part's tokens: twice the budget, twice the probe's cached logits
    one = activation_bytes(probe, 0, "cuda")["controller_peak_bytes"]
    two = activation_bytes(probe.with_changes(max_tokens_per_microbatch=256), 0, "cuda")["controller_peak_bytes"]
    assert two > one


def test_validate_measures_the_packed_kl_probe_within_bounds():
    # the step's peak in the KL probe (full recompute keeps the backward small): parts of 4 rows
    # of 32 tokens packed, the s = 0 logits of both parts held through the forecast
    proc = subprocess.run(
        [sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--validate", "--json", "--optimizer", "logra",
         "--bf16", "--logra-rank", "0.25", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--kl-probe-sequences", "8", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--seq-length", "32", "--max-tokens-per-microbatch", "128", "--steps", "1"],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    [record] = json.loads(proc.stdout.strip().splitlines()[-1])["ranks"]
    peak, breakdown = record["peak_step"], record["plan_breakdown"]
    assert breakdown["controller_peak_bytes"] == peak["predicted"] > breakdown["forward_backward_peak_bytes"]
    assert abs(peak["error"]) <= PEAK_BOUND, (peak, breakdown)


def _run_config(**run) -> TrainConfig:
    return TrainConfig(model=ModelSourceConfig(preset="tiny"), model_config=get_preset("tiny"), run=RunConfig(**run))


def test_the_trainers_plan_takes_the_runs_token_budget():
    settings = plan_settings(_run_config(max_tokens_per_microbatch=3000), 1, 512, "logra")
    assert settings.packed and settings.tokens_per_microbatch == 3000
    doubled = plan_settings(_run_config(max_tokens_per_microbatch=6000), 1, 512, "logra")
    assert 1.9 < _saved(doubled) / _saved(settings) < 2.1


def test_the_trainers_plan_takes_its_default_budget_and_no_pack_sequences():
    config = _run_config()
    settings = plan_settings(config, 1, 512, "logra")
    # the GRPO passes' default: --micro-batch-size (capped by the step's rows) x the rows' length
    assert settings.max_tokens_per_microbatch == default_token_budget(settings.micro_batch_size, 512)
    padded = plan_settings(_run_config(pack_sequences=False), 1, 512, "logra")
    assert not padded.packed and padded.tokens_per_microbatch == padded.micro_batch_size * 512


def test_the_trainers_start_up_line_plans_the_packed_run():
    planned = plan_summary(_run_config(max_tokens_per_microbatch=3000), 1, 512)
    assert 0 < planned["logra"] < planned["adam"]
    assert plan_summary(_run_config(max_tokens_per_microbatch=6000), 1, 512)["logra"] > planned["logra"]


def _cli(*args):
    return subprocess.run([sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--json", *args],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)


def test_the_cli_packs_by_default_with_the_trainers_budget():
    packed = json.loads(_cli("--micro-batch-size", "2", "--seq-length", "64").stdout)["settings"]
    assert packed["packed"] and packed["tokens_per_microbatch"] == default_token_budget(2, 64)
    padded = json.loads(_cli("--micro-batch-size", "2", "--seq-length", "64", "--no-pack-sequences").stdout)
    assert not padded["settings"]["packed"]
    budget = json.loads(_cli("--max-tokens-per-microbatch", "4096").stdout)["settings"]
    assert budget["tokens_per_microbatch"] == 4096
    proc = _cli("--max-tokens-per-microbatch", "-1")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --max-tokens-per-microbatch must be >= 0, got -1"
