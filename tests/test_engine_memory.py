"""A rollout engine's memory is declared once, by the engine (logra_megatron/engine_memory.py), and
both the engine's own sizing and the planner read that declaration: the vLLM engine's KV cache,
reserved at start at ``kv_cache_mb`` MiB or what two of the model's longest sequences need, is
what the plan counts for it, whichever of the two wins.

vLLM is not needed: a stand-in module records the ``vllm.LLM`` arguments the engine's ``_start``
passes, the number vLLM would reserve. The planner's command line takes the trainer's
``--rollout-engine`` (a package engine or outside code) and plans what that engine declares."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from dist_harness import REPO

from logra_megatron.engine_memory import MIB
from logra_megatron.errors import UserError
from logra_megatron.models.config import get_preset
from logra_megatron.planning.settings import PlanSettings, RolloutPlan
from logra_megatron.planning.state import stage_state
from logra_megatron.rollout import vllm_engine
from logra_megatron.rollout.engine import ROLLOUT_ENGINES, engine_memory


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


# --- the planner's command line: --rollout-engine, the trainer's flag ------------------------------

PLUGINS = REPO / "tests" / "plugins"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(PLUGINS)]))


def _plan_cli(*flags):
    return subprocess.run([sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--bf16", "--optimizer", "adam",
                           "--json", *flags], capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)


def _rollout_and_weights(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    components = json.loads(proc.stdout)["plans"]["adam"]["stages"][0]["components"]
    return components["rollout_bytes"], components["weight_bytes"]


def test_the_planner_plans_an_outside_engine_by_flag_as_it_declares(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    from echo_engine import EchoEngine, PagedKVCache

    model = get_preset("tiny")
    rollout, weights = _rollout_and_weights(_plan_cli("--rollout-sequences", "3", "--rollout-max-tokens", "100",
                                                      "--rollout-engine", "echo_engine:EchoEngine"))
    assert isinstance(EchoEngine.memory, PagedKVCache)
    declared = EchoEngine.memory.bytes(layers=model.layers, kv_heads=model.kv_heads, kv_channels=model.kv_channels,
                                       sequences=3, max_tokens=100, model_max_tokens=model.max_seq, dtype_bytes=2,
                                       weight_numel=weights // 2)
    # its bf16 weights and 3 sequences of two 64-token pages: K and V x 4 layers x 2 kv heads x 16 x 2 bytes
    assert rollout == declared == weights + 3 * 128 * (2 * 4 * 2 * 16 * 2)
    # the package's engines by name; --rollout-engine-weights still stands for its two engines
    vllm, _ = _rollout_and_weights(_plan_cli("--rollout-sequences", "3", "--rollout-engine", "vllm"))
    assert vllm == weights + vllm_engine.VLLMEngine.memory.kv_cache_mb * MIB
    megatron, _ = _rollout_and_weights(_plan_cli("--rollout-sequences", "3", "--rollout-engine", "megatron"))
    shared, _ = _rollout_and_weights(_plan_cli("--rollout-sequences", "3"))
    separate, _ = _rollout_and_weights(_plan_cli("--rollout-sequences", "3", "--rollout-engine-weights", "separate"))
    assert megatron == shared == separate - weights > 0
    # agreeing flags plan the engine's declaration
    assert _rollout_and_weights(_plan_cli("--rollout-sequences", "3", "--rollout-engine", "vllm",
                                          "--rollout-engine-weights", "separate"))[0] == vllm


@pytest.mark.parametrize("flags, message", [
    (("--rollout-engine", "no_such_module:Engine"),
     "error: plan_memory: argument --rollout-engine: no_such_module:Engine: no module named 'no_such_module' "
     "(is its directory on PYTHONPATH?) (see --help)"),
    (("--rollout-engine", "echo_engine:NoSuchEngine"),
     "error: plan_memory: argument --rollout-engine: echo_engine:NoSuchEngine: echo_engine has no attribute "
     "'NoSuchEngine' (see --help)"),
    (("--rollout-engine", "megatron", "--rollout-engine-weights", "separate"),
     "error: --rollout-engine-weights separate contradicts --rollout-engine megatron, which samples with the "
     "trainer's weights; give one of the two"),
])
def test_a_bad_engine_for_the_planner_is_one_error_line(flags, message):
    proc = _plan_cli("--rollout-sequences", "3", *flags)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == message


def test_the_planner_reads_a_package_engine_without_importing_it():
    """A package engine's declaration comes through its registry line (``memory=``): planning
    ``--rollout-engine vllm`` loads neither torch nor the engine's module, and it is the very object
    the engine's class holds."""
    script = "\n".join([
        "import sys",
        "sys.path.insert(0, 'tools')",
        "import plan_memory",
        "args = plan_memory.parse_args(['--preset', 'tiny', '--rollout-sequences', '2', '--rollout-engine', 'vllm'])",
        "plan_memory.run_plans(args)",
        "print(type(args.rollout_engine_memory).__name__, 'torch' in sys.modules,",
        "      'logra_megatron.rollout.vllm_engine' in sys.modules)"])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ReservedKVCache", "False", "False"]
    for name in ROLLOUT_ENGINES:
        assert engine_memory(name) is ROLLOUT_ENGINES.get(name).memory
