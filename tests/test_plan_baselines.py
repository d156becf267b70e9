"""The memory planner's dense baseline rows (logra_megatron/planning/state.py
``dense_optimizer_bytes``; settings.py ``ROWS``) against bytes computed by hand for the tiny model
(bf16, one GPU), and the planner's ``--optimizer all`` report.

Megatron-Core's precision-aware Adam without offload needs Transformer Engine's FusedAdam, which
is not installed here, and its CPU offload needs CUDA streams: both are checked by their
arithmetic only (the byte counts read from megatron/core/optimizer/ as state.py cites)."""

import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron.errors import UserError
from logra_megatron.models.config import get_preset
from logra_megatron.planning.plan import plan_memory
from logra_megatron.planning.settings import ROWS, PlanSettings, settings_for_row
from logra_megatron.planning.state import stage_host_state, stage_state

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
GIB = 1024**3

# tiny: hidden 64, 4 layers, 4/2 heads (head dim 16), FFN 128, vocab 256, untied.
LAYER = dict(proj=64 * 64, qkv=(64 + 2 * 2 * 16) * 64, fc1=2 * 128 * 64, fc2=64 * 128)  # + two norms of 64
N = 4 * (sum(LAYER.values()) + 2 * 64) + 2 * 256 * 64 + 64  # 180800 parameters
TENSORS = 4 * 6 + 3  # 27
N_PADDED = 180864  # the distributed optimizer's buffer: one bucket padded to lcm(DP = 1, 128)
BLOCKS = 4 * sum(-(-n // 256) for n in LAYER.values()) + 2 * (256 * 64 // 256)  # 8-bit scales per moment
SMALL = 4 * 2 * 64 + 64  # the norms: under 4096 elements, fp32 moments


def _row(row, bf16=True, model="tiny", **changes):
    base = PlanSettings(model=get_preset(model), bf16=bf16, kl_control="probe", global_batch_size=8,
                        seq_length=32, **changes)
    return settings_for_row(base, row)


def _state(row, **changes):
    settings = _row(row, **changes)
    return stage_state(settings, 0), stage_host_state(settings, 0)


def test_the_model_is_counted_right():
    assert N == 180800 and BLOCKS == 704
    state, _ = _state("adam")
    assert state["weight_bytes"] == 2 * N


def test_adam_as_users_run_it_is_18_bytes_and_no_controller():
    state, host = _state("adam")
    assert (state["weight_bytes"], state["grad_bytes"], state["master_bytes"]) == (2 * N, 4 * N, 4 * N)
    assert state["moment_bytes"] == 8 * N + 4 * TENSORS and state["controller_extra_bytes"] == 0
    assert not any(host.values())


def test_adam_kl_adds_the_controllers_two_fp32_copies_of_the_mains():
    plain, _ = _state("adam")
    state, _ = _state("adam-kl")
    assert state["controller_extra_bytes"] == 2 * 4 * N
    assert {k: v for k, v in state.items() if k != "controller_extra_bytes"} == \
        {k: v for k, v in plain.items() if k != "controller_extra_bytes"}
    # --kl-control off on the command line still plans the controller for this row (probe)
    assert settings_for_row(_row("logra").with_changes(kl_control="off"), "adam-kl").kl_control == "probe"


@pytest.mark.parametrize("exp_avg,exp_avg_sq,moment_bytes", [
    ("bf16", "bf16", 4 * N), ("fp8", "fp8", 2 * N), ("fp8", "bf16", 3 * N), ("fp32", "fp32", 8 * N)])
def test_precision_aware_bf16_grads_16_bit_remainders_and_moment_dtypes(exp_avg, exp_avg_sq, moment_bytes):
    settings = _row("adam-precision-aware", exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq)
    assert settings.distributed_optimizer and settings.kl_control == "off"
    state, host = stage_state(settings, 0), stage_host_state(settings, 0)
    # weights and the bf16 grad buffer are padded by the distributed optimizer; the int16 master
    # remainders and the moments cover the parameters; FusedAdam's step is in its param group
    assert (state["weight_bytes"], state["grad_bytes"], state["master_bytes"]) == (2 * N_PADDED, 2 * N_PADDED, 2 * N)
    assert state["moment_bytes"] == moment_bytes and not any(host.values())


def test_precision_aware_is_10_bytes_a_parameter_and_4_plus_6_over_d_sharded():
    settings = _row("adam-precision-aware", model="qwen2.5-7b").with_changes(tensor_parallel=2)
    for dp in (1, 4):
        s = settings.with_changes(data_parallel=dp, global_batch_size=8)
        state = stage_state(s, 0)
        numel = state["weight_bytes"] / 2
        per_param = sum(state[k] for k in ("weight_bytes", "grad_bytes", "master_bytes", "moment_bytes")) / numel
        assert per_param == pytest.approx(4 + 6 / dp, rel=1e-4)


def test_precision_aware_with_fp32_weights_keeps_no_remainders():
    state, _ = _state("adam-precision-aware", bf16=False)
    assert state["master_bytes"] == 0 and state["weight_bytes"] == 4 * N_PADDED


def test_cpu_offload_of_everything_leaves_weights_and_grads_on_the_gpu():
    state, host = _state("adam-cpu-offload")
    assert (state["weight_bytes"], state["grad_bytes"]) == (2 * N_PADDED, 4 * N_PADDED)
    assert state["master_bytes"] == state["moment_bytes"] == 0
    assert host == {"host_master_bytes": 4 * N, "host_grad_bytes": 4 * N,
                    "host_moment_bytes": 8 * N + 4 * TENSORS}
    plan = plan_memory(_row("adam-cpu-offload"))
    assert plan.host_per_gpu == 16 * N + 4 * TENSORS == plan.host_total
    assert plan.to_dict()["host_bytes"] == plan.host_per_gpu


def test_cpu_offload_fraction_moves_whole_tensors_until_the_fraction_is_reached():
    # the optimizer's order here: the buffer's (reverse registration): output layer, final norm,
    # layer 3 (fc2, fc1, norm, qkv, proj, norm), layer 2 ...; half of N is 90400 elements
    offloaded = 256 * 64 + 64 + (sum(LAYER.values()) + 2 * 64) + LAYER["fc2"] + LAYER["fc1"] + 64 + LAYER["qkv"] \
        + LAYER["proj"] + 64
    assert offloaded == 90432
    state, host = _state("adam-cpu-offload", optimizer_offload_fraction=0.5)
    assert host["host_master_bytes"] == 4 * offloaded and host["host_grad_bytes"] == 4 * offloaded
    assert host["host_moment_bytes"] == 8 * offloaded + 4 * 14
    assert state["master_bytes"] == 4 * (N - offloaded) and state["moment_bytes"] == 8 * (N - offloaded) + 4 * 13
    state, host = _state("adam-cpu-offload", optimizer_offload_fraction=0.0)
    assert not any(host.values()) and state["moment_bytes"] == 8 * N + 4 * TENSORS


def test_8bit_adam_blockwise_moments():
    state, host = _state("adam-8bit")
    assert (state["weight_bytes"], state["grad_bytes"], state["master_bytes"]) == (2 * N, 4 * N, 4 * N)
    assert state["moment_bytes"] == 2 * (N - SMALL) + 2 * 4 * BLOCKS + 8 * SMALL + 4 * TENSORS
    assert not any(host.values())


def test_baselines_refuse_the_controller_and_unknown_rows():
    with pytest.raises(UserError, match="without the KL controller"):
        stage_state(_row("adam").with_changes(optimizer="adam-8bit", kl_control="probe"), 0)
    with pytest.raises(UserError, match="distributed optimizer"):
        stage_state(_row("adam-precision-aware").with_changes(distributed_optimizer=False), 0)
    with pytest.raises(UserError, match="optimizer row"):
        settings_for_row(_row("adam"), "sgd")
    with pytest.raises(UserError, match="offload-fraction"):
        stage_state(_row("adam-cpu-offload", optimizer_offload_fraction=1.5), 0)


def test_cli_all_rows_on_8_gpus_of_80_gb():
    """The issue's "done when" command: every row with GPU and host bytes and a verdict."""
    proc = subprocess.run([sys.executable, "tools/plan_memory.py", "--preset", "qwen2.5-32b", "--bf16", "--gpus", "8",
                           "--gpu-memory-gib", "80", "--search", "--optimizer", "all", "--json"],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    search = json.loads(proc.stdout)["search"]
    assert tuple(search) == ROWS
    best = {row: search[row]["best"] for row in ROWS}
    for row, entry in best.items():
        assert entry["row"] == row and entry["gpu_bytes"] == entry["total_per_gpu_bytes"] > 0
        assert {"host_bytes", "host_total_bytes", "fits", "headroom_bytes"} <= set(entry)
    assert not best["adam"]["fits"] and not best["adam-kl"]["fits"]
    assert best["adam-precision-aware"]["fits"] and best["adam-8bit"]["fits"] and best["adam-cpu-offload"]["fits"]
    assert best["logra"]["fits"]
    assert best["adam-cpu-offload"]["host_bytes"] > 50 * GIB and best["logra"]["host_bytes"] == 0
    assert best["adam-kl"]["gpu_bytes"] - best["adam"]["gpu_bytes"] > 12 * GIB
    assert best["logra"]["gpu_bytes"] < best["adam-precision-aware"]["gpu_bytes"] < best["adam"]["gpu_bytes"]


def test_cpu_offload_with_bf16_main_grads_halves_the_gpu_gradient_buffer():
    state, host = _state("adam-cpu-offload", main_grads_dtype="bf16")
    assert state["grad_bytes"] == 2 * N_PADDED and host["host_grad_bytes"] == 4 * N


def _cli(*args):
    return subprocess.run([sys.executable, "tools/plan_memory.py", *args], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=REPO)


def test_cli_table_prints_host_memory_and_validate_refuses_unbuilt_rows():
    proc = _cli("--preset", "tiny", "--bf16", "--optimizer", "adam-cpu-offload", "--global-batch-size", "4",
                "--gpu-memory-gib", "80")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dense Adam, CPU offload: TP 1 x PP 1 x DP 1" in proc.stdout and "distributed optimizer on" in proc.stdout
    assert "host_moment_bytes (host)" in proc.stdout and "host memory of the job" in proc.stdout
    proc = _cli("--preset", "tiny", "--bf16", "--optimizer", "adam-8bit", "--validate")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "planned only" in lines[0], proc.stderr


def test_a_dense_row_declared_by_its_owner_is_planned_without_touching_planning():
    # optim/dense_memory.py's DENSE_ROWS is where a dense optimizer says what it holds; one
    # registered from outside the package (here, a test) is planned like the built-in rows
    from logra_megatron.optim.dense_memory import DENSE_ROWS, adam
    from logra_megatron.planning.state import stage_state

    def half_moments(settings, grad_buffer_numel, mains):
        gpu, host = adam(settings, grad_buffer_numel, mains)
        gpu["moment_bytes"] //= 2
        return gpu, host

    if "test-half-moments" not in DENSE_ROWS:
        DENSE_ROWS.register("test-half-moments", half_moments, needs_distributed=True, controller=False)
    base = PlanSettings(model=get_preset("tiny"), optimizer="logra", bf16=True, global_batch_size=2)
    row = settings_for_row(base, "test-half-moments")
    assert row.distributed_optimizer and row.kl_control == "off" and row.dense  # as the row declares
    planned = stage_state(row, 0)
    adam_row = stage_state(settings_for_row(base.with_changes(distributed_optimizer=True), "adam"), 0)
    assert planned["moment_bytes"] == adam_row["moment_bytes"] // 2 > 0
    assert planned["master_bytes"] == adam_row["master_bytes"]
