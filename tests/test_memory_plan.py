"""The memory planner (logra_megatron/planning, tools/plan_memory.py): per-parameter figures of
Megatron's dense Adam, LoGRA's sketch bytes against a built model and logra/accounting.py, the
planned state against the live tensors of tiny in-process runs, and the command line.

Multi-rank layouts are measured against the plan by logra_megatron/planning/validate.py."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron.engine_memory import KEEPS_ITS_OWN_WEIGHTS, SAMPLES_WITH_TRAINER_WEIGHTS
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models.config import get_preset
from logra_megatron.planning.plan import fits, plan_memory, search_layouts
from logra_megatron.planning.settings import PlanSettings, RolloutPlan
from logra_megatron.planning.state import ADAM_STEP_BYTES, parameter_shapes, stage_state

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
GIB = 1024**3
MEGATRON_STATE = ("weight_bytes", "grad_bytes", "master_bytes", "moment_bytes")


def _dense(model, **changes) -> PlanSettings:
    return PlanSettings(model=model, optimizer="adam", bf16=True, kl_control="off",
                        global_batch_size=8, **changes)


def test_dense_bf16_adam_is_18_bytes_per_parameter():
    settings = _dense(get_preset("qwen2.5-7b"), tensor_parallel=2, pipeline_parallel=2)
    for stage in (0, 1):
        params = parameter_shapes(settings, stage)
        numel = sum(p.numel for p in params)
        state = stage_state(settings, stage)
        # 2 (bf16 weight) + 4 (fp32 grad) + 4 (fp32 master) + 8 (two fp32 moments), plus torch's
        # 4-byte step counter per tensor.
        assert sum(state[key] for key in MEGATRON_STATE) == 18 * numel + ADAM_STEP_BYTES * len(params)
        assert state["weight_bytes"] == 2 * numel and state["moment_bytes"] > 8 * numel > 0


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_distributed_optimizer_is_6_plus_12_over_d_bytes_per_parameter(dp):
    settings = _dense(get_preset("qwen2.5-7b"), tensor_parallel=2, data_parallel=dp, distributed_optimizer=True)
    numel = sum(p.numel for p in parameter_shapes(settings, 0))
    for rank in range(dp):
        state = stage_state(settings, 0, dp_rank=rank)
        per_param = sum(state[key] for key in MEGATRON_STATE) / numel
        # exact up to Megatron's padding (64-element parameter starts, lcm(DP, 128) buckets)
        assert per_param == pytest.approx(6 + 12 / dp, rel=1e-4)
        assert per_param != pytest.approx(18, rel=1e-2)
    # and the planned number of bytes per GPU drops with DP as the docs say
    plans = [plan_memory(settings.with_changes(data_parallel=d)).total_per_gpu for d in (1, 2, 4)]
    assert plans[0] > plans[1] > plans[2]


def test_fp32_dense_adam_has_no_masters():
    settings = _dense(get_preset("tiny")).with_changes(bf16=False)
    state = stage_state(settings, 0)
    numel = sum(p.numel for p in parameter_shapes(settings, 0))
    assert state["master_bytes"] == 0 and state["weight_bytes"] == state["grad_bytes"] == 4 * numel


def test_pipeline_stages_place_embeddings_like_megatron():
    untied = _dense(get_preset("qwen2.5-7b"), pipeline_parallel=4)
    names = [[p.name for p in parameter_shapes(untied, stage)] for stage in range(4)]
    assert names[0][0] == "embedding.word_embeddings.weight" and "output_layer.weight" in names[3]
    assert not any("embedding" in n or "output_layer" in n for n in names[1] + names[2])
    tied = _dense(get_preset("qwen2.5-1.5b"))  # tied at PP 1: one weight
    assert "output_layer.weight" not in [p.name for p in parameter_shapes(tied, 0)]
    tied_pp = tied.with_changes(pipeline_parallel=2)  # the last stage keeps a copy
    last = {p.name: p for p in parameter_shapes(tied_pp, 1)}
    assert last["output_layer.weight"].shared_embedding
    vocab_rows = get_preset("qwen2.5-1.5b").padded_vocab(4) // 4
    sharded = {p.name: p.shape for p in parameter_shapes(tied_pp.with_changes(tensor_parallel=4), 0)}
    assert sharded["embedding.word_embeddings.weight"] == (vocab_rows, 1536)
    assert sharded["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 8960 // 4, 1536)  # column-parallel
    assert sharded["decoder.layers.0.mlp.linear_fc2.weight"] == (1536, 8960 // 4)  # row-parallel
    assert sharded["decoder.layers.0.input_layernorm.weight"] == (1536,)  # replicated


def _built(kind, bf16=False, distributed=False, embeddings=False, update="adam", bucket_size=None, **model_changes):
    """A tiny model built at TP 1 with its optimizer, one step taken under the KL controller."""
    import torch

    from logra_megatron import parallel
    from logra_megatron.training.config import KLControlConfig, OptimizerSettings
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable

    model_config = get_preset("tiny").with_changes(**model_changes)
    logra = LogRAConfig(rank=16, embeddings=embeddings, zero1=distributed, update=update)
    parallel.initialize(1, 1)
    model, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind=kind, distributed=distributed),
                                            logra, dtype=torch.bfloat16 if bf16 else torch.float32,
                                            overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size)
    tokens = torch.randint(0, model_config.vocab, (2, 17))
    probe = ProbeSet(tokens[:1], torch.ones(1, 17), micro_batch_size=1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, tokens, 2)
    control = PredictedKLController(KLControlConfig(mode="probe", realized_interval=0)).step(ddp, optimizer, probe)
    settings = PlanSettings(model=model_config, optimizer=kind, distributed_optimizer=distributed, bf16=bf16,
                            logra=logra, kl_control="probe", micro_batch_size=2, global_batch_size=2,
                            overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size)
    return model, optimizer, control, settings


def _measured(model, optimizer, control) -> dict:
    """Live tensors by component, as tools/benchmark_optimizer.py measures them (plus the norm
    probes' directions)."""
    from logra_megatron.platform.memory import tensor_bytes

    seen = set()
    state = optimizer.state_bytes()
    weights = tensor_bytes(model.parameters(), seen)
    sketches = directions = 0
    if hasattr(optimizer, "sketch_buffer"):
        samples = optimizer.norm_estimator.flat if optimizer.norm_estimator is not None else None
        sketches = tensor_bytes([optimizer.sketch_buffer.flat, samples], seen)
        directions = tensor_bytes([entry.sketch.norm_probe for entry in optimizer.weights], seen)
    return {"weight_bytes": weights, "master_bytes": state["master_weight_bytes"],
            "grad_bytes": state["grad_bytes"] - sketches, "sketch_bytes": sketches, "norm_probe_bytes": directions,
            "moment_bytes": state["optimizer_state_bytes"], "projection_bytes": state["projection_bytes"],
            "controller_extra_bytes": control["controller_extra_bytes"]}


@pytest.mark.parametrize("kind,bf16,distributed,embeddings,tied,update", [
    ("adam", False, False, False, False, "adam"), ("logra", False, False, False, False, "adam"),
    ("adam", True, True, False, True, "adam"), ("logra", True, True, True, True, "adam"),
    ("logra", True, False, True, False, "rowadam")])
def test_planned_state_equals_the_live_tensors(kind, bf16, distributed, embeddings, tied, update):
    model, optimizer, control, settings = _built(kind, bf16, distributed, embeddings, update,
                                                 tie_embeddings=tied, qkv_bias=tied)
    planned = stage_state(settings, 0)
    measured = _measured(model, optimizer, control)
    assert {key: planned[key] for key in measured} == measured
    assert measured["weight_bytes"] > 0 and measured["moment_bytes"] > 0 and measured["controller_extra_bytes"] > 0
    assert (measured["sketch_bytes"] > 0) == (kind == "logra")
    assert (measured["master_bytes"] > 0) == bf16


@pytest.mark.parametrize("kind", ("adam", "logra"))
def test_planned_state_equals_the_live_tensors_with_overlapped_buckets(kind):
    # --overlap-grad-reduce with small buckets under the distributed optimizer: Megatron pads every
    # bucket's end to lcm(DP, 128) elements, so several buckets hold more than one would
    model, optimizer, control, settings = _built(kind, True, True, bucket_size=64, tie_embeddings=True)
    planned = stage_state(settings, 0)
    assert {key: planned[key] for key in _measured(model, optimizer, control)} == _measured(model, optimizer, control)
    one_bucket = stage_state(dataclasses.replace(settings, overlap_grad_reduce=False), 0)
    assert planned["grad_bytes"] > one_bucket["grad_bytes"]


def test_sketch_buckets_pad_to_the_data_parallel_size():
    from logra_megatron.planning.state import sketch_buffer_numel

    numels = [10, 7, 5, 3]
    assert sketch_buffer_numel(numels, [False] * 4, 4, None) == 28  # one bucket of 25 elements
    assert sketch_buffer_numel(numels, [False] * 4, 4, 12) == 20 + 8  # buckets [10, 7] and [5, 3]
    assert sketch_buffer_numel(numels, [True, False, False, False], 4, 100) == 12 + 16  # the shared embedding alone
    assert sketch_buffer_numel(numels, [False] * 4, 1, 12) == 25


def test_cli_takes_megatrons_overlap_flags_with_its_rule():
    base = ["--preset", "tiny", "--optimizer", "logra", "--use-distributed-optimizer", "--data-parallel-size", "2",
            "--json"]
    one = json.loads(_cli(*base).stdout)
    overlapped = json.loads(_cli(*base, "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
                                 "2000").stdout)
    assert overlapped != one
    refused = _cli("--preset", "tiny", "--overlap-param-gather", check=False)
    assert refused.returncode != 0 and "--overlap-param-gather needs --use-distributed-optimizer" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_logra_sketch_bytes_match_the_built_sketches_and_the_accounting():
    from logra_megatron.logra.accounting import state_bytes
    from logra_megatron.logra.sketch import LinearSketch

    model, optimizer, _, settings = _built("logra", bf16=True)
    planned = stage_state(settings, 0)
    sketch_numel = sum(math.prod(LinearSketch.sketch_shape(e.sketch.side, e.sketch.out_features,
                                                           e.sketch.in_features, e.sketch.rank))
                       for e in optimizer.weights)
    probes = settings.logra.norm_probes * sum(
        e.sketch.out_features if e.sketch.side == "right" else e.sketch.in_features for e in optimizer.weights)
    assert sketch_numel > 0 and planned["sketch_bytes"] == 4 * (sketch_numel + probes)
    accounted = state_bytes(model, settings.logra)["logra"]
    assert planned["grad_bytes"] + planned["sketch_bytes"] == accounted.grad_bytes
    assert planned["projection_bytes"] == accounted.projection_bytes > 0
    assert planned["master_bytes"] == accounted.master_weight_bytes > 0
    # the dense remainder's Adam, step counters included, as both read it from optim/dense_memory.py
    assert planned["moment_bytes"] == accounted.optimizer_state_bytes
    # and the dense side: Megatron's Adam over every parameter, the planner's adam row
    dense, dense_plan = state_bytes(model, settings.logra)["dense"], stage_state(settings.with_changes(optimizer="adam"), 0)
    assert ((dense.grad_bytes, dense.master_weight_bytes, dense.optimizer_state_bytes)
            == (dense_plan["grad_bytes"], dense_plan["master_bytes"], dense_plan["moment_bytes"]))


def test_kv_cache_engine_weights_and_reference_model():
    model = get_preset("qwen2.5-32b")
    shared = _dense(model, tensor_parallel=8, reference_model=True,
                    rollout=RolloutPlan(sequences_in_flight=4, max_tokens=1000, engine=SAMPLES_WITH_TRAINER_WEIGHTS))
    state = stage_state(shared, 0)
    # K and V x 64 layers x 8 kv heads / TP 8 x head dim 128 x 4000 tokens x 2 bytes
    assert state["rollout_bytes"] == 2 * 64 * 1 * 128 * 4000 * 2
    assert state["reference_model_bytes"] == state["weight_bytes"] > 0
    separate = stage_state(shared.with_changes(rollout=RolloutPlan(4, 1000, engine=KEEPS_ITS_OWN_WEIGHTS)), 0)
    assert separate["rollout_bytes"] == state["rollout_bytes"] + state["weight_bytes"]


def test_an_engine_declares_its_memory_and_the_plan_follows_it(monkeypatch):
    """A new engine touches no file of the planner: its class's ``memory`` says what it holds."""
    from logra_megatron.engine_memory import EngineMemory
    from logra_megatron.rollout.engine import engine_memory

    class PagedCache(EngineMemory):  # an engine that allocates its cache in 256-token pages
        def kv_cache_bytes(self, layers, kv_heads, kv_channels, tokens, dtype_bytes):
            return super().kv_cache_bytes(layers, kv_heads, kv_channels, -(-tokens // 256) * 256, dtype_bytes)

    settings = _dense(get_preset("tiny"), rollout=RolloutPlan(sequences_in_flight=3, max_tokens=100,
                                                              engine=PagedCache(own_weights=False)))
    # K and V x 4 layers x 2 kv heads x head dim 16 x 512 tokens (300 in pages of 256) x 2 bytes
    assert stage_state(settings, 0)["rollout_bytes"] == 2 * 4 * 2 * 16 * 512 * 2
    # the package's engines and an outside one, as the trainer's start-up plan reads them (rl/memory_plan.py)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "plugins"))
    assert engine_memory("megatron") is SAMPLES_WITH_TRAINER_WEIGHTS
    assert engine_memory("vllm").own_weights and engine_memory("echo_engine:EchoEngine").own_weights


def test_search_prefers_the_layout_with_the_most_headroom():
    base = PlanSettings(model=get_preset("qwen2.5-32b"), bf16=True, optimizer="logra",
                        logra=LogRAConfig(rank=256), global_batch_size=8)
    choices = search_layouts(base, 8, 80 * GIB, optimizers=("adam", "logra"))
    for choice in choices.values():
        totals = [row["total_per_gpu_bytes"] for row in choice.candidates]
        assert choice.plan.total_per_gpu == min(totals) and len(set(totals)) > 1
        assert fits(choice.plan, 80 * GIB)[1] == 80 * GIB - choice.plan.total_per_gpu
    assert choices["logra"].plan.total_per_gpu < choices["adam"].plan.total_per_gpu
    assert all(row["tensor_parallel"] <= 8 for row in choices["logra"].candidates)


# --- Megatron's interleaved pipeline (virtual pipeline) -------------------------------------------

def _interleaved(chunks=2, **changes) -> PlanSettings:
    return PlanSettings(model=get_preset("tiny").with_changes(layers=8), pipeline_parallel=2, virtual_pipeline=chunks,
                        optimizer="adam", kl_control="off", micro_batch_size=2, global_batch_size=8,
                        seq_length=64).with_changes(**changes)


def test_chunks_place_layers_embedding_and_head_like_megatron():
    settings = _interleaved()  # 8 layers, PP 2, 2 chunks per rank: virtual stages of 2 layers
    layers = [sorted({int(p.name.split(".")[2]) for p in parameter_shapes(settings, rank) if ".layers." in p.name})
              for rank in (0, 1)]
    assert layers == [[0, 1, 4, 5], [2, 3, 6, 7]]  # rank r holds chunks r and r + PP
    first, last = ([p.name for p in parameter_shapes(settings, rank)] for rank in (0, 1))
    assert first[0] == "embedding.word_embeddings.weight" and "output_layer.weight" not in first
    assert last[-1] == "output_layer.weight" and not any("embedding" in name for name in last)
    # the same parameters per rank as without chunks, and so the same state without the
    # distributed optimizer's padding
    plain = settings.with_changes(virtual_pipeline=None)
    for rank in (0, 1):
        assert sum(p.numel for p in parameter_shapes(settings, rank)) == sum(p.numel for p in parameter_shapes(plain, rank))
        assert stage_state(settings, rank) == stage_state(plain, rank)
    # under it each chunk's DDP buffer is padded on its own (training/setup.py: one DDP per chunk;
    # the QKV bias leaves a chunk's end off the 128-element multiple)
    dist = _interleaved(model=get_preset("tiny").with_changes(qkv_bias=True), tensor_parallel=2,
                        distributed_optimizer=True)
    assert stage_state(dist, 0)["grad_bytes"] > stage_state(dist.with_changes(virtual_pipeline=None), 0)["grad_bytes"]


def test_interleaved_order_is_megatrons_schedule_table():
    from logra_megatron.planning.activations import interleaved_order, interleaved_warmup

    # megatron-core 0.16.1 model_parallel_config.py's examples, PP 2 x VP 2: rank 0 runs
    # "0 1 0 1 2 3 2 3" with groups of 2 (M = 4) and "0 1 2 0 1 2 3 4 3 4" with groups of 3 (M = 5)
    for microbatches, shown in ((4, [0, 1, 0, 1, 2, 3, 2, 3]), (5, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4])):
        settings = _interleaved(micro_batch_size=1, global_batch_size=microbatches)
        order = interleaved_order(settings, 0)
        assert [mb for kind, mb, _ in order if kind == "F"] == shown
        # the warm-up: 2 (PP - r - 1) + (V - 1) N forwards before the first backward, which
        # runs the last chunk of the first microbatch
        warmup = 2 * 1 + (2 - 1) * (2 if microbatches == 4 else 3)
        assert interleaved_warmup(settings, 0) == warmup
        assert [kind for kind, _, _ in order[:warmup + 2]] == ["F"] * (warmup + 1) + ["B"]
        assert order[warmup + 1] == ("B", 0, 1)


def test_interleaved_group_size_is_the_trainers():
    # the replay runs the group size the trainer sets (layout.py: microbatch_group_size, read by
    # training/lm.py), not Megatron's default of PP: they differ where M % PP is neither 0 nor >= PP
    from logra_megatron.layout import microbatch_group_size
    from logra_megatron.planning.activations import _group_size

    differs = 0
    for microbatches in range(1, 12):
        settings = PlanSettings(model=get_preset("tiny"), optimizer="adam", pipeline_parallel=2, virtual_pipeline=2,
                                pack_sequences=False, micro_batch_size=1, global_batch_size=microbatches)
        expected = microbatch_group_size(max(microbatches, 2), 2)
        assert _group_size(settings) == expected
        differs += expected != 2
    assert differs > 0


def test_interleaved_warmup_keeps_more_chunk_passes_in_flight_than_1f1b():
    from logra_megatron.planning.activations import activation_bytes

    chunks, plain = _interleaved(), _interleaved(chunks=None)
    # 1F1B: PP - r microbatches of the rank's 4 layers; interleaved: 2 (PP - r - 1) + (V - 1) PP
    # + 1 chunk passes of 2 layers each (rank 0: 5 x 2 = 10 layer passes against 2 x 4 = 8)
    assert [activation_bytes(plain, rank)["microbatches_in_flight"] for rank in (0, 1)] == [2, 1]
    assert [activation_bytes(chunks, rank)["microbatches_in_flight"] for rank in (0, 1)] == [5, 3]
    for rank in (0, 1):
        ours, theirs = activation_bytes(chunks, rank), activation_bytes(plain, rank)
        assert ours["saved_activations_bytes"] > theirs["saved_activations_bytes"], rank
        assert ours["peak_step_bytes"] > theirs["peak_step_bytes"], rank
    # one layer's saved tensors per chunk pass and layer: rank 0 holds 10 layer passes against 8
    ratio = activation_bytes(chunks, 0)["saved_activations_bytes"] / activation_bytes(plain, 0)["saved_activations_bytes"]
    assert 1.2 < ratio < 1.3


def test_the_trainers_start_up_plan_under_the_interleaved_pipeline():
    from logra_megatron.rl.config import ModelSourceConfig, ParallelConfig, TrainConfig
    from logra_megatron.rl.memory_plan import plan_line, plan_settings, plan_summary

    model = get_preset("tiny")
    parallel = ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    config = TrainConfig(model=ModelSourceConfig(preset="tiny"), model_config=model, parallel=parallel)
    assert plan_settings(config, 2, 128, "logra").virtual_pipeline == 2
    planned = plan_summary(config, 2, 128)
    assert "unavailable" not in planned and planned["logra"] > 0 and planned["adam"] > 0
    assert plan_line(planned).startswith("memory plan per GPU")
    plain = plan_summary(TrainConfig(model=ModelSourceConfig(preset="tiny"), model_config=model,
                                     parallel=ParallelConfig(pipeline_model_parallel_size=2)), 2, 128)
    assert planned["logra"] != plain["logra"]


# --- the command line ------------------------------------------------------------------------------

def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "tools/plan_memory.py", *args], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_cli_prints_a_table_for_both_optimizers():
    out = _cli("--preset", "gemma-2-27b", "--bf16", "--tensor-model-parallel-size", "8",
               "--gpus", "8", "--gpu-memory-gib", "141", "--global-batch-size", "8").stdout
    assert "dense Adam: TP 8 x PP 1 x DP 1" in out and "LoGRA: TP 8 x PP 1 x DP 1" in out
    assert "weight_bytes" in out and "sketch_bytes" in out and "total" in out and "headroom" in out


def test_cli_json_and_model_config_file(tmp_path):
    config = tmp_path / "model_config.json"
    config.write_text(json.dumps(get_preset("tiny").to_dict()))
    report = json.loads(_cli("--model-config", str(config), "--pipeline-model-parallel-size", "2",
                             "--global-batch-size", "4", "--json").stdout)
    assert set(report["plans"]) == {"adam", "logra"}
    for plan in report["plans"].values():
        assert len(plan["stages"]) == 2 and plan["total_per_gpu_bytes"] > 0
        assert plan["total_per_gpu_bytes"] == max(stage["total_bytes"] for stage in plan["stages"])
    assert report["settings"]["model"]["hidden"] == 64


def test_cli_search_on_8_gpus_of_80_gb_dense_does_not_fit_logra_does():
    # the README's command: rank 256, 64 rollout sequences of 2048 tokens colocated (KV cache)
    report = json.loads(_cli("--preset", "qwen2.5-32b", "--bf16", "--gpus", "8", "--gpu-memory-gib", "80",
                             "--search", "--logra-rank", "256", "--rollout-sequences", "64", "--json").stdout)
    dense, logra = report["search"]["adam"]["best"], report["search"]["logra"]["best"]
    assert not dense["fits"] and dense["headroom_bytes"] < 0
    assert logra["fits"] and logra["headroom_bytes"] > 10 * GIB
    assert all(not row["fits"] for row in report["search"]["adam"]["candidates"])
    kv_cache = 2 * 64 * 8 * 128 * 64 * 2048 * 2 // (logra["layout"]["tensor_parallel"] * logra["layout"]["pipeline_parallel"])
    assert logra["stages"][0]["components"]["rollout_bytes"] == kv_cache


def test_cli_default_rank_fits_qwen_32b_on_8_gpus_of_80_gb():
    """No --logra-rank: the default (0.5 of each dimension, at most 256) fits LoGRA, with room
    the uncapped fraction (r = 2560) does not leave; dense Adam fits no layout."""
    report = json.loads(_cli("--preset", "qwen2.5-32b", "--bf16", "--gpus", "8", "--gpu-memory-gib", "80",
                             "--search", "--json").stdout)
    assert (report["settings"]["logra"]["rank"], report["settings"]["logra"]["max_rank"]) == (0.5, 256)
    logra = report["search"]["logra"]["best"]
    assert logra["fits"] and logra["headroom_bytes"] > 10 * GIB and not report["search"]["adam"]["best"]["fits"]


def test_cli_default_rank_fits_qwen_32b_on_one_141_gb_gpu_and_dense_adam_does_not():
    """The issue's single-GPU job (bf16-sr, sketched embeddings, full recomputation) at the
    default rank; the uncapped fraction does not fit."""
    command = ("--preset", "qwen2.5-32b", "--bf16", "--gpus", "1", "--gpu-memory-gib", "141", "--logra-master",
               "bf16-sr", "--logra-embeddings", "--recompute-granularity", "full", "--recompute-method", "uniform",
               "--recompute-num-layers", "1", "--json")
    plans = json.loads(_cli(*command).stdout)["plans"]
    assert plans["logra"]["fits"] and plans["logra"]["headroom_bytes"] > 10 * GIB
    assert not plans["adam"]["fits"]
    uncapped = json.loads(_cli(*command, "--logra-max-rank", "0").stdout)["plans"]
    assert not uncapped["logra"]["fits"]


@pytest.mark.parametrize("args,message", [
    (("--preset", "gpt-9"), "invalid choice"),
    (("--preset", "qwen2.5-32b", "--tensor-model-parallel-size", "3"), "not divisible by tensor-parallel"),
    (("--preset", "tiny", "--pipeline-model-parallel-size", "3"), "not divisible by pipeline-parallel"),
    (("--preset", "tiny", "--gpus", "6", "--tensor-model-parallel-size", "4"), "not divisible by TP"),
    (("--preset", "tiny", "--search"), "--search needs --gpus"),
    (("--model-config", "/nonexistent/model_config.json"), "cannot read --model-config"),
    # the virtual pipeline flags, checked by the trainer's own ParallelConfig
    (("--preset", "tiny", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-virtual-stages-per-pipeline-rank", "2"), "say the same thing two ways"),
    (("--preset", "tiny", "--num-virtual-stages-per-pipeline-rank", "2"), "needs --pipeline-model-parallel-size > 1"),
    (("--preset", "tiny", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"),
     "must divide the 2 layers of a pipeline stage"),
])
def test_cli_bad_input_is_one_error_line(args, message):
    proc = _cli(*args, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr


def test_cli_plans_the_interleaved_pipeline():
    # either flag, Megatron's meanings: 1 layer per chunk of tiny's 2 per stage = 2 chunks per rank
    args = ("--preset", "tiny", "--pipeline-model-parallel-size", "2", "--optimizer", "logra", "--global-batch-size",
            "8", "--json")
    by_layers = json.loads(_cli(*args, "--num-layers-per-virtual-pipeline-stage", "1").stdout)["plans"]["logra"]
    by_chunks = json.loads(_cli(*args, "--num-virtual-stages-per-pipeline-rank", "2").stdout)["plans"]["logra"]
    assert by_layers == by_chunks and by_layers["layout"]["virtual_pipeline"] == 2
    plain = json.loads(_cli(*args).stdout)["plans"]["logra"]
    assert "virtual_pipeline" not in plain["layout"]
    assert by_layers["stages"][0]["peak_step_bytes"] > plain["stages"][0]["peak_step_bytes"]
    refused = _cli(*args, "--num-virtual-stages-per-pipeline-rank", "2", "--gpus", "2", "--gpu-memory-gib", "80",
                   "--search", check=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--search does not vary" in refused.stderr


def test_cli_plot_writes_a_png(tmp_path):
    path = tmp_path / "memory.png"
    proc = _cli("--preset", "qwen2.5-7b", "--bf16", "--gpus", "8", "--gpu-memory-gib", "80", "--search",
                "--global-batch-size", "8", "--plot", str(path), check=False)
    if importlib.util.find_spec("matplotlib") is None:  # the planner still answers in one line
        assert proc.returncode == 2 and "needs matplotlib" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
