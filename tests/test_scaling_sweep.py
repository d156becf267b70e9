"""The TP/PP scaling sweep (``launch/scaling_sweep.sh``) on one layout of 4 ranks (TP2 x DP2,
dense Adam and LoGRA, 2 steps + 1 measured) plus one layout the model does not divide, and the
collective counter it measures with (``tests/workers/comm_counter_checks.py`` on 2 ranks)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import REPO, result, run_workers

FLOAT = 4


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return run_workers("comm_counter_checks.py", 2, tmp_path_factory.mktemp("comm_counter"))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling_sweep")
    env = dict(os.environ, LOGRA_SKIP_SETUP="1", OMP_NUM_THREADS="1", PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        ["bash", "launch/scaling_sweep.sh", "--out", str(out), "--steps", "2", "--nproc", "4",
         "--layouts", "2x1 4x1", "--optimizers", "adam logra"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    table = json.loads((out / "table.json").read_text())
    return {"rows": {(row["tp"], row["pp"], row["optimizer"]): row for row in table["rows"]},
            "markdown": (out / "table.md").read_text(), "stdout": proc.stdout}


# --- the counter against hand counts -------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_counter_equals_hand_count_of_an_all_reduce(counter, rank):
    found = result(counter, "known_all_reduce", rank)
    assert found["expected_bytes"] == 3 * 5 * FLOAT
    assert found["records"] == {"all_reduce 0,1": [1, found["expected_bytes"]]}
    assert found["value"] == 3.0  # 1 + 2: the wrapped call still reduced


def test_gathers_and_scatters_count_the_whole_buffer_once(counter):
    found = result(counter, "gathers_and_scatters", 1)
    # _all_gather_base calls all_gather_single inside torch: counted once, under the outer name
    assert found["records"] == {"all_gather_into_tensor 0,1": [1, 8 * FLOAT], "_all_gather_base 0,1": [1, 6 * FLOAT],
                                "reduce_scatter_tensor 0,1": [1, 10 * FLOAT], "all_gather 0,1": [1, 4 * FLOAT]}
    assert found["gathered"] == [0.0] * 4 + [1.0] * 4 and found["shard"] == [2.0] * 5


@pytest.mark.parametrize("rank", [0, 1])
def test_batched_point_to_point_counts_each_send_and_receive(counter, rank):
    found = result(counter, "batched_p2p", rank)
    assert found["records"] == {"isend 0,1": [1, 7 * FLOAT], "irecv 0,1": [1, 7 * FLOAT]}
    assert found["received"] == [float(1 - rank)] * 7


def test_coalesced_all_reduces_are_counted_when_queued(counter):
    found = result(counter, "coalesced_all_reduce")
    assert found["records"] == {"all_reduce 0,1": [2, (6 + 10) * FLOAT]}
    assert found["sums"] == [2.0, 2.0]


def test_functions_are_restored_after_the_block(counter):
    found = result(counter, "object_collective_and_restore", 1)
    assert found["wrapped_inside"] and found["restored"]
    assert found["grew_after_exit"] == 0
    calls, size = found["records"]["broadcast 0,1"]  # broadcast_object_list's inner broadcasts
    assert calls == 2 and size > 0 and found["received"] == {"rank": 0}


@pytest.mark.parametrize("mode", ["plain", "batched"])
def test_megatrons_pipeline_send_and_receive_are_seen(counter, mode):
    sender = result(counter, "megatron_pipeline_p2p", 0)[mode]
    receiver = result(counter, "megatron_pipeline_p2p", 1)[mode]
    size = 4 * 2 * 8 * FLOAT
    assert sender["summary"]["by_op"] == {"isend": {"pp": {"calls": 1, "bytes": size}}}
    assert receiver["summary"]["by_op"] == {"irecv": {"pp": {"calls": 1, "bytes": size}}}
    assert receiver["received"] == 0.0  # the first stage's activation arrived


def test_megatrons_tensor_parallel_all_reduce_is_seen(counter):
    found = result(counter, "megatron_tensor_parallel", 1)
    assert found["summary"]["by_kind"] == {"tp": 3 * 4 * FLOAT}
    assert found["value"] == 3.0


def test_group_kind_names_the_dimensions_a_group_spans(counter):
    assert result(counter, "kinds") == {"tp": "tp", "pp": "pp", "tp+pp": "tp+pp", "self": "self"}


# --- the sweep -----------------------------------------------------------------------------------

def test_table_has_every_row_and_no_empty_cell(sweep):
    lines = [line for line in sweep["markdown"].splitlines() if line.startswith("|")]
    header, body = lines[0], lines[2:]
    columns = len(header.strip("|").split("|"))
    assert len(body) == 4  # 2 layouts x 2 optimizers
    for line in body:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == columns and all(cells), line


def test_a_layout_the_model_does_not_divide_is_skipped_with_the_reason(sweep):
    for optimizer in ("adam", "logra"):
        row = sweep["rows"][(4, 1, optimizer)]
        assert row["status"] == "skipped"
        assert "2 kv heads" in row["note"] and "tensor-parallel size 4" in row["note"]


@pytest.mark.parametrize("optimizer", ["adam", "logra"])
def test_bytes_move_on_exactly_the_groups_the_layout_has(sweep, optimizer):
    row = sweep["rows"][(2, 1, optimizer)]
    assert row["status"] == "ok", row["note"]
    moved = row["comm_bytes"]
    assert moved["tp"] > 0 and moved["dp"] > 0
    assert moved["pp"] == 0  # PP=1: no pipeline group, no traffic
    assert all(kind["dp"] > 0 for kind in row["comm_by_rank"])
    assert row["comm_by_op_rank0"]["all_reduce"]["tp"]["calls"] > 0


def test_logra_reduces_fewer_bytes_over_data_parallel_than_dense(sweep):
    dense, logra = sweep["rows"][(2, 1, "adam")], sweep["rows"][(2, 1, "logra")]
    assert 0 < logra["comm_bytes"]["dp"] < dense["comm_bytes"]["dp"]


def test_logra_holds_less_training_state_per_rank_than_dense(sweep):
    dense, logra = sweep["rows"][(2, 1, "adam")], sweep["rows"][(2, 1, "logra")]
    assert 0 < logra["state_bytes_max"] < dense["state_bytes_max"]


@pytest.mark.parametrize("optimizer", ["adam", "logra"])
def test_measured_figures_are_real(sweep, optimizer):
    row = sweep["rows"][(2, 1, optimizer)]
    assert len(row["state_bytes_by_rank"]) == 4 and min(row["state_bytes_by_rank"]) > 0
    assert row["peak_step_bytes_max"] > 0 and row["step_time_s"] > 0
    assert math.isfinite(row["final_loss"]) and 0 < row["final_loss"] < 2 * math.log(256)
