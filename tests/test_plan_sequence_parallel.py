"""The memory planner under Megatron's ``--sequence-parallel`` (planning/activations.py): the
tensors outside the tensor-parallel regions are planned at 1/TP of the sequence, the gathered
inputs of the column-parallel linears are not saved, the pipeline messages are sequence slices,
Megatron's global buffer holds the gathered input; figures hand-computed for tiny at TP2. The
measured check (``--validate`` under SP) is in tests/test_plan_validation.py."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron.errors import UserError
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models.config import get_preset
from logra_megatron.planning.activations import activation_bytes, global_buffer_bytes
from logra_megatron.planning.plan import plan_memory, search_layouts
from logra_megatron.planning.settings import PlanSettings

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
TINY = get_preset("tiny")  # hidden 64, 4 layers
T = 2 * 32  # tokens of a microbatch: 2 rows of 32
FP32 = 4


def _settings(**changes) -> PlanSettings:
    base = PlanSettings(model=TINY, tensor_parallel=2, optimizer="adam", kl_control="off", micro_batch_size=2,
                        global_batch_size=8, seq_length=32, logra=LogRAConfig(rank=0.25))
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("optimizer", ("adam", "logra"))
def test_sequence_parallel_halves_the_saved_sequence_split_tensors_at_tp2(optimizer):
    # fp32, one stage: the peak is the output layer's backward, with every layer's saved tensors
    # live. Split along the sequence under SP: the 9 residual tensors (the embedding output and
    # each layer's res1 and res2, fp32 saves the residual as the next norm's input) and the 9
    # RMSNorms' normalized input, output (T x h each) and 1/rms (T): per tensor half of
    # (3 T h + T) fp32 elements less at TP2. Nothing else changes: the q/k/v, attention and MLP
    # tensors are whole-sequence in both, and the column-parallel linears save only their input
    # slice (Megatron's and LoGRA's sketching linears alike), not the gathered input.
    h, layers = TINY.hidden, TINY.layers
    plain = activation_bytes(_settings(optimizer=optimizer), 0, "cuda")
    split = activation_bytes(_settings(optimizer=optimizer, sequence_parallel=True), 0, "cuda")
    tensors = 2 * layers + 1
    assert plain["saved_activations_bytes"] - split["saved_activations_bytes"] == tensors * (3 * T * h + T) * FP32 // 2
    assert plain["logits_bytes"] == split["logits_bytes"]  # logits are T x V/TP either way
    assert split["peak_step_bytes"] < plain["peak_step_bytes"]


def test_pipeline_messages_are_sequence_slices():
    # stage 1 of PP2 holds the activation it received (T x h, fp32) until its backward: the
    # sequence slice under SP (Megatron's p2p shapes are seq_length / TP)
    h = TINY.hidden
    plain = activation_bytes(_settings(pipeline_parallel=2), 1, "cuda")
    split = activation_bytes(_settings(pipeline_parallel=2, sequence_parallel=True), 1, "cuda")
    assert plain["pipeline_buffers_bytes"] == T * h * FP32
    assert split["pipeline_buffers_bytes"] == T * h * FP32 // 2


def test_megatrons_linears_gather_into_its_global_buffer_logras_into_their_own():
    h = TINY.hidden
    assert global_buffer_bytes(_settings()) == 0  # sdpa, no SP: no buffer
    # dense: every column-parallel linear gathers T x h into the kept "mpu" buffer
    assert global_buffer_bytes(_settings(sequence_parallel=True)) == T * h * FP32
    assert global_buffer_bytes(_settings(sequence_parallel=True, bf16=True)) == T * h * 2
    # LoGRA: only Megatron's output layer does (the last stage)
    logra = _settings(optimizer="logra", sequence_parallel=True, pipeline_parallel=2)
    assert global_buffer_bytes(logra, 0) == 0 and global_buffer_bytes(logra, 1) == T * h * FP32
    # the KL probe's padded rows (seq_length + 1 = 33, up to 34 at TP2) are a larger gather
    probe = _settings(sequence_parallel=True, kl_control="probe", kl_probe_sequences=2)
    assert global_buffer_bytes(probe) == 2 * 34 * h * FP32
    assert plan_memory(_settings(sequence_parallel=True)).stages[0].global_buffer_bytes == T * h * FP32


def test_packed_microbatches_are_padded_to_a_multiple_of_tp():
    packed = _settings(pack_sequences=True, max_tokens_per_microbatch=63)
    assert packed.tokens_per_microbatch == 63
    assert dataclasses.replace(packed, sequence_parallel=True).tokens_per_microbatch == 64


def test_sequence_parallel_needs_tp_and_a_divisible_sequence():
    with pytest.raises(UserError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        activation_bytes(_settings(tensor_parallel=1, sequence_parallel=True), 0)
    with pytest.raises(UserError, match="--seq-length 33 must be divisible"):
        activation_bytes(_settings(sequence_parallel=True, seq_length=33, global_batch_size=8), 0)
    # LoGRA's sketched embedding refuses SP (logra/embeddings.py): not planned as if it ran
    with pytest.raises(UserError, match="--logra-embeddings does not run under --sequence-parallel"):
        activation_bytes(_settings(optimizer="logra", logra=LogRAConfig(rank=0.25, embeddings=True),
                                   sequence_parallel=True), 0)


def test_search_keeps_the_users_sequence_parallel_where_tp_is_above_one():
    base = _settings(sequence_parallel=True, tensor_parallel=1, global_batch_size=16)
    choices = search_layouts(base, 4, 80 * 1024**3, ("adam",), gpus_per_node=4)
    choice = choices["adam"]
    # TP1 layouts run without SP, not refused (TP4 is, for tiny's 2 kv heads)
    assert [(row["tensor_parallel"], "kv heads" in row["reason"]) for row in choice.skipped] == [(4, True)]
    assert {row["tensor_parallel"] for row in choice.candidates} == {1, 2}
    for tp, pp, dp in ((1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2)):
        settings = dataclasses.replace(base, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                                       sequence_parallel=tp > 1)
        row = next(r for r in choice.candidates if (r["tensor_parallel"], r["pipeline_parallel"]) == (tp, pp))
        assert row["total_per_gpu_bytes"] == plan_memory(settings).total_per_gpu, (tp, pp)


def _cli(*args):
    return subprocess.run([sys.executable, str(REPO / "tools" / "plan_memory.py"), *args], capture_output=True,
                          text=True, env=ENV, timeout=300)


def test_cli_plans_sequence_parallel_and_refuses_it_at_tp1():
    common = ("--preset", "tiny", "--tensor-model-parallel-size", "2", "--seq-length", "32", "--micro-batch-size",
              "2", "--global-batch-size", "8", "--optimizer", "adam", "--json")
    plain = json.loads(_cli(*common).stdout)["plans"]["adam"]
    split = json.loads(_cli(*common, "--sequence-parallel").stdout)["plans"]["adam"]
    assert split["stages"][0]["step"]["peak_step_bytes"] < plain["stages"][0]["step"]["peak_step_bytes"]
    proc = _cli("--preset", "tiny", "--sequence-parallel")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and "--sequence-parallel needs --tensor-model-parallel-size > 1" in lines[0]
