"""A rollout engine's memory is declared once, by the engine (logra_megatron/engine_memory.py), and
both the engine's own sizing and the planner read that declaration: the vLLM engine's KV cache,
reserved at start at ``kv_cache_mb`` MiB or what two of the model's longest sequences need, is
what the plan counts for it, whichever of the two wins.

vLLM is not needed: a stand-in module records the ``vllm.LLM`` arguments the engine's ``_start``
passes, the number vLLM would reserve."""

from types import SimpleNamespace

import pytest
import torch

from logra_megatron.engine_memory import MIB
from logra_megatron.errors import UserError
from logra_megatron.models.config import get_preset
from logra_megatron.planning.settings import PlanSettings, RolloutPlan
from logra_megatron.planning.state import stage_state
from logra_megatron.rollout import vllm_engine
from logra_megatron.rollout.engine import engine_memory


def _reserved_by_the_engine(monkeypatch, model_config, **options) -> int:
    """``kv_cache_memory_bytes`` of the ``vllm.LLM`` the vLLM engine builds for ``model_config``
    (bf16, the model's longest sequence as its ``max_model_len``)."""
    built = {}
    fake_vllm = SimpleNamespace(LLM=lambda **kwargs: built.update(kwargs) or "llm")
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake_vllm)
    monkeypatch.setattr(vllm_engine, "check_head_dim", lambda head_dim: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # _start sets it: restored after the test
    # what unwrap_model finds in a built policy: the GPTModel, which carries the model's max_seq
    policy = SimpleNamespace(decoder=None, max_sequence_length=model_config.max_seq)
    engine = vllm_engine.VLLMEngine(policy, model_config=model_config, **options)
    try:
        assert engine._start(model_config, torch.bfloat16) == "llm"
    finally:
        engine._remove_folder()
    assert built["max_model_len"] == model_config.max_seq
    return built["kv_cache_memory_bytes"]


def _planned_cache(model_config, sequences: int, max_tokens: int) -> int:
    """The planner's rollout bytes for the vLLM engine at TP = PP = 1 (where the engine holds the
    same layers and heads as the rank), less its weights' bf16 copy (held only with an engine)."""
    settings = PlanSettings(model=model_config, optimizer="adam", bf16=True, kl_control="off", global_batch_size=8,
                            rollout=RolloutPlan(sequences_in_flight=sequences, max_tokens=max_tokens,
                                                engine=engine_memory("vllm")))
    state = stage_state(settings, 0)
    return state["rollout_bytes"] - (state["weight_bytes"] if sequences else 0)


@pytest.mark.parametrize("preset, floor_wins", [("tiny", True), ("qwen2.5-1.5b", False)])
def test_the_plan_counts_the_kv_cache_the_vllm_engine_reserves(monkeypatch, preset, floor_wins):
    model_config = get_preset(preset)
    reserved = _reserved_by_the_engine(monkeypatch, model_config)
    floor = vllm_engine.VLLMEngine.memory.kv_cache_mb * MIB
    # tiny: 2 x 4 layers x 2 kv heads x 16 x 2 bytes x 2 x 256 tokens = 256 KiB, below the floor;
    # qwen2.5-1.5b: 28672 bytes a token x 2 x 32768 tokens = 1.75 GiB, above it
    assert (reserved == floor) == floor_wins and reserved >= floor
    # one cache of that size however many sequences are in flight, and none without an engine
    for sequences, max_tokens in ((1, 64), (64, 1024), (512, model_config.max_seq)):
        assert _planned_cache(model_config, sequences, max_tokens) == reserved
    assert _planned_cache(model_config, 0, 0) == 0


def test_a_kv_cache_size_given_to_the_engine_is_the_one_it_reserves(monkeypatch):
    model_config = get_preset("tiny")
    assert _reserved_by_the_engine(monkeypatch, model_config, kv_cache_mb=3) == 3 * MIB
    # the class's declaration, which the planner reads, keeps its default
    assert engine_memory("vllm") is vllm_engine.VLLMEngine.memory and engine_memory("vllm").kv_cache_mb != 3
    with pytest.raises(UserError, match="kv_cache_mb must be >= 1"):
        vllm_engine.VLLMEngine(None, model_config=model_config, kv_cache_mb=0)
