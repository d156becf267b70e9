"""The memory planner (logra_megatron/planning) against measured runs of tiny: every training
state component within 5% and the step's peak of tracked allocations within 10%, per rank, at
TP2 x PP2 and at DP2 with the distributed optimizer, dense Adam and LoGRA, fp32 and bf16 (one
torchrun launch per layout: tests/workers/plan_validation_checks.py), and at TP2 x PP2 under
``--sequence-parallel`` (packed) and under Megatron's interleaved pipeline (two chunks per rank). In-process: what the
activation model must show (recomputation, pipeline depth, the CPU tracker's view)."""

import dataclasses

import pytest

from dist_harness import result, run_workers
from logra_megatron.errors import UserError
from logra_megatron.models.config import get_preset
from logra_megatron.planning.activations import activation_bytes
from logra_megatron.planning.settings import PlanSettings
from logra_megatron.planning.validate import COMPONENT_BOUND, PEAK_BOUND
from logra_megatron.platform.memory import collective_frees, replay_allocations

COMBOS = ("adam_fp32", "adam_bf16", "logra_fp32", "logra_bf16")
LAYOUTS = {"tp2pp2": 4, "dp2dist": 2}
SP_COMBOS = ("adam_fp32_sp", "logra_bf16_sp")
"""Measured under ``--sequence-parallel`` in the TP layouts (packed microbatches)."""
VPP_COMBOS = ("adam_fp32_vpp", "logra_bf16_vpp")
"""Measured under Megatron's interleaved pipeline in the PP layouts (two chunks per rank)."""
CASES = ([(layout, combo) for layout in LAYOUTS for combo in COMBOS] + [("tp2pp2", combo) for combo in SP_COMBOS]
         + [("tp2pp2", combo) for combo in VPP_COMBOS])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return {layout: run_workers("plan_validation_checks.py", ranks, tmp_path_factory.mktemp(layout),
                                args=("--layout", layout))
            for layout, ranks in LAYOUTS.items()}


@pytest.mark.parametrize("layout,combo", CASES)
def test_plan_matches_measurement(measured, layout, combo):
    for rank in range(LAYOUTS[layout]):
        record = result(measured[layout], combo, rank)
        where = f"{layout} {combo} rank {rank}"
        assert record["sequence_parallel"] == combo.endswith("_sp"), where  # the model as built
        assert record["model_chunks"] == (2 if combo.endswith("_vpp") else 1), where
        nonzero = [name for name, item in record["components"].items() if item["measured"] > 0]
        assert "weight_bytes" in nonzero and "moment_bytes" in nonzero, where
        for name, item in record["components"].items():
            assert abs(item["error"]) <= COMPONENT_BOUND, (where, name, item)
        peak = record["peak_step"]
        assert peak["measured"] > 0 and peak["predicted"] > 0, where
        assert abs(peak["error"]) <= PEAK_BOUND, (where, peak, record["plan_breakdown"])


@pytest.mark.parametrize("combo", VPP_COMBOS)
def test_planned_state_per_rank_equals_the_live_tensors_under_the_interleaved_pipeline(measured, combo):
    # PP2 with two chunks per rank: each rank's layers, its embedding or head, and each chunk's
    # own DDP buffer (padded on its own under the distributed optimizer) give every persistent
    # component to the byte
    for rank in range(LAYOUTS["tp2pp2"]):
        record = result(measured["tp2pp2"], combo, rank)
        for name, item in record["components"].items():
            assert item["predicted"] == item["measured"], (combo, rank, name, item)


def _settings(**changes):
    base = PlanSettings(model=get_preset("tiny"), optimizer="adam", kl_control="off", micro_batch_size=2,
                        global_batch_size=8, seq_length=64)
    return dataclasses.replace(base, **changes)


def test_recompute_lowers_the_saved_activations():
    none = activation_bytes(_settings(), 0)
    selective = activation_bytes(_settings(recompute_granularity="selective"), 0)
    full = activation_bytes(_settings(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1), 0)
    assert full["peak_step_bytes"] < selective["peak_step_bytes"] < none["peak_step_bytes"]
    assert full["recompute_bytes"] > 0


def test_the_first_pipeline_stage_holds_a_microbatch_per_stage():
    settings = _settings(pipeline_parallel=2, global_batch_size=8)
    first, last = activation_bytes(settings, 0), activation_bytes(settings, 1)
    assert first["microbatches_in_flight"] == 2 and last["microbatches_in_flight"] == 1
    per_layer_first = first["saved_activations_bytes"]
    assert per_layer_first > last["saved_activations_bytes"]


def test_the_cpu_tracker_counts_widened_bf16_products():
    settings = _settings(bf16=True)
    assert activation_bytes(settings, 0, "cpu")["peak_step_bytes"] > activation_bytes(settings, 0, "cuda")["peak_step_bytes"]


def test_bad_recompute_settings_are_one_error():
    with pytest.raises(UserError, match="recompute-num-layers"):
        activation_bytes(_settings(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3), 0)
    with pytest.raises(UserError, match="platform"):
        activation_bytes(_settings(), 0, "tpu")


@pytest.mark.parametrize("platform", ("cpu", "cuda"))
@pytest.mark.parametrize("layers", (1, 2))
def test_full_recompute_of_a_stages_last_layer_under_the_pipeline(platform, layers):
    # PP2, full uniform recompute: the group ending at stage 0's last layer re-runs it in the
    # backward while, on the CPU, the schedule still holds the output it sent (two tensors,
    # not one allocated twice)
    settings = _settings(pipeline_parallel=2, recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=layers)
    plain = _settings(pipeline_parallel=2)
    for stage in (0, 1):
        planned = activation_bytes(settings, stage, platform)
        assert planned["recompute_bytes"] > 0, (stage, planned)
        assert planned["forward_backward_peak_bytes"] < activation_bytes(plain, stage, platform)["forward_backward_peak_bytes"]
    # the CPU keeps the sent outputs of stage 0's microbatches in flight (CUDA frees their data)
    cpu, cuda = activation_bytes(settings, 0, "cpu"), activation_bytes(settings, 0, "cuda")
    assert cpu["pipeline_buffers_bytes"] > cuda["pipeline_buffers_bytes"], (cpu, cuda)


def test_the_cpu_replay_frees_a_collectives_copy_its_worker_released_unseen():
    # As measured at dp2dist (adam bf16, rank 1): gloo's coalesced reduce-scatter clones the
    # gradient buffer on the caller's thread (inside its c10d op) and all-reduces the copy on a
    # worker; when the worker drops the Work last, the profiler never sees the copy freed. The
    # replay frees it when the worker's run ends, so a later, smaller peak is not raised by it.
    dispatches = [(10, False), (50, True), (100, False)]  # an all-reduce, a send (inline), the reduce-scatter
    runs = [(12, 20), (105, 150)]  # the workers' runs of the two non-inline ops
    copy = (101, 800, 0xA0, 2)  # allocated inside the reduce-scatter's op, its free unseen
    later = [(200, 300, 0xB0, None), (210, -300, 0xB0, None)]  # the step's later peak
    frees = collective_frees([copy] + later, dispatches, runs)
    assert frees == [(150, -800, 0xA0)]
    events = [item[:3] for item in [copy] + later]
    assert replay_allocations(events + frees) == (800, 0)
    assert replay_allocations(events) == (1100, 800)  # without it: the copy counted to the end
    # a free the profiler saw is not freed twice, and a block outside any collective is the
    # caller's own: kept
    seen = [copy, (160, -800, 0xA0, None)]
    assert collective_frees(seen, dispatches, runs) == []
    mine = (101, 800, 0xA0, None)
    assert collective_frees([mine], dispatches, runs) == []
