"""Model presets, the parallel layout's validation, and the CPU adapter (one process)."""

import pytest
import torch

from logra_megatron.errors import UserError
from logra_megatron.models import PRESETS, ModelConfig, get_preset
from logra_megatron.layout import ParallelLayout
from logra_megatron.platform import cuda_available

# Published parameter counts (billions) of the models the presets mirror.
PUBLISHED_BILLIONS = {"smollm2-135m": 0.135, "qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.54,
                      "qwen2.5-7b": 7.62, "llama3-8b": 8.03, "qwen2.5-32b": 32.8}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_preset_parameter_counts_match_published(name):
    billions = get_preset(name).num_parameters() / 1e9
    assert abs(billions - PUBLISHED_BILLIONS[name]) / PUBLISHED_BILLIONS[name] < 0.02


def test_unknown_preset_lists_known_names():
    with pytest.raises(UserError, match="tiny"):
        get_preset("gpt-5")


def test_model_config_validation():
    with pytest.raises(UserError, match="kv_heads"):
        ModelConfig(hidden=64, layers=2, heads=4, kv_heads=3, ffn_hidden=128, vocab=100)
    with pytest.raises(UserError, match="unknown model config keys: colour"):
        ModelConfig.from_dict({**PRESETS["tiny"].to_dict(), "colour": 1})
    assert ModelConfig.from_dict(PRESETS["tiny"].to_dict()) == PRESETS["tiny"]
    assert PRESETS["tiny"].padded_vocab(2) == 256
    assert PRESETS["smollm2-135m"].padded_vocab(4) == 49152


def test_layout_validation_says_what_to_change():
    layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=2, world_size=8)
    assert layout.data_parallel == 2
    with pytest.raises(UserError, match="not divisible by tensor-parallel 2 x pipeline-parallel 2"):
        ParallelLayout(2, 2, 6)
    with pytest.raises(UserError, match=">= 1"):
        ParallelLayout(0, 1, 1)
    tiny = get_preset("tiny")
    with pytest.raises(UserError, match="4 attention heads, not divisible by tensor-parallel size 8"):
        ParallelLayout(8, 1, 8).check_model(tiny.layers, tiny.heads, tiny.kv_heads, tiny.ffn_hidden, tiny.vocab, "tiny")
    with pytest.raises(UserError, match="4 layers, not divisible by pipeline-parallel size 3"):
        ParallelLayout(1, 3, 3).check_model(tiny.layers, tiny.heads, tiny.kv_heads, tiny.ffn_hidden, tiny.vocab, "tiny")
    ParallelLayout(2, 2, 4).check_model(tiny.layers, tiny.heads, tiny.kv_heads, tiny.ffn_hidden, tiny.vocab)


@pytest.mark.skipif(cuda_available(), reason="the adapter is only installed without CUDA")
def test_cpu_adapter_stand_ins():
    from logra_megatron.platform import setup_platform

    assert setup_platform() == "cpu"
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)


@pytest.mark.skipif(cuda_available(), reason="the adapter is only installed without CUDA")
def test_cpu_rng_tracker_forks_are_reproducible_and_isolated():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from logra_megatron.platform import setup_platform

    setup_platform()

    def draw():
        model_parallel_cuda_manual_seed(42, tp_rank=0, ep_rank=0, etp_rank=0)
        outside = torch.rand(3)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(3)
        after = torch.rand(3)
        return outside, inside, after

    first, second = draw(), draw()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # The fork draws from its own stream: the default stream continues where it left off.
    torch.manual_seed(42)
    expected = torch.rand(6)
    assert torch.equal(torch.cat([first[0], first[2]]), expected)
    assert not torch.equal(first[1], expected[3:])


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU")
def test_cuda_platform_installs_no_adapter():
    from logra_megatron.platform import setup_platform
    from logra_megatron.platform import cpu_adapter

    assert setup_platform() == "cuda"
    assert not cpu_adapter._INSTALLED
