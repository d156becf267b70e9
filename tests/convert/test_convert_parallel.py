"""Converted tiny Llama / Qwen2 / Mistral models reproduce HF logits at TP=1, TP=2 and PP=2,
gather back bitwise, and reshard through a dist checkpoint. One 2-rank launch for all."""

import pytest
from convert_tiny import TINY
from dist_harness import result, run_workers

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
TOLERANCE = 1e-4  # fp32


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    args = [f"{name}={path}" for name, path in tiny_models.items()]
    return run_workers("convert_checks.py", 2, tmp_path_factory.mktemp("convert"), args=args)


def assert_logits_match(results, check):
    last_stage_ranks = 0
    for rank in range(2):
        value = result(results, check, rank)
        if value["last_stage"]:
            last_stage_ranks += 1
            assert value["max_abs_diff"] < TOLERANCE, value
            assert value["scale"] > 0.1, value  # the logits are not trivially small
    assert last_stage_ranks >= 1


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("name", list(TINY))
def test_megatron_logits_equal_hf(results, name, tp, pp):
    assert_logits_match(results, f"logits_{name}_tp{tp}_pp{pp}")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("name", list(TINY))
def test_sharded_model_gathers_back_to_the_hf_tensors_bitwise(results, name, tp, pp):
    for rank in range(2):
        value = result(results, f"gather_{name}_tp{tp}_pp{pp}", rank)
        assert value == {"names_differ": [], "tensors_differ": []}


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 1)])
@pytest.mark.parametrize("name", ["qwen2_tied", "llama_untied_hd32"])
def test_checkpoint_saved_at_tp2_loads_elsewhere(results, name, tp, pp):
    assert result(results, f"ckpt_save_{name}") is True
    assert_logits_match(results, f"ckpt_load_{name}_tp{tp}_pp{pp}")
