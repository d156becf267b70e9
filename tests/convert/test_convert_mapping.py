"""Single-process checks of the pure HF <-> Megatron mappings (no torch.distributed)."""

import json
import os

import pytest
import torch
from convert_tiny import TINY

from logra_megatron.convert.hf import (
    check_hf_names,
    detect_family,
    fuse_qkv,
    hf_config_from_model_config,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    model_config_from_hf,
    split_qkv,
    supported_architectures,
)
from logra_megatron.convert.hf_io import HFWeights, read_hf_config
from logra_megatron.errors import UserError
from logra_megatron.models import ModelConfig, get_preset


def hf_state(directory):
    weights = HFWeights(directory)
    return {name: weights[name] for name in weights}


@pytest.mark.parametrize("name", list(TINY))
def test_model_config_from_hf(tiny_models, name):
    family, tie, extra = TINY[name]
    config = model_config_from_hf(read_hf_config(tiny_models[name]))
    assert (config.family, config.tie_embeddings, config.qkv_bias) == (family, tie, family == "qwen2")
    assert (config.hidden, config.layers, config.heads, config.kv_heads) == (64, 2, 4, 2)
    assert (config.ffn_hidden, config.vocab, config.max_seq) == (128, 1000, 256)
    assert config.kv_channels == extra.get("head_dim", 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TINY))
def test_hf_megatron_hf_is_bitwise(tiny_models, name, dtype):
    original = {k: v.to(dtype) for k, v in hf_state(tiny_models[name]).items()}
    config = model_config_from_hf(read_hf_config(tiny_models[name]))
    check_hf_names(original, config)
    megatron = hf_to_megatron(original, config)
    assert sorted(megatron) == sorted(megatron_names(config))
    back = megatron_to_hf(megatron, config)
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", ["qwen2_tied", "llama_untied_hd32"])
def test_megatron_shapes_and_vocab_padding(tiny_models, name):
    config = model_config_from_hf(read_hf_config(tiny_models[name]))
    megatron = hf_to_megatron(hf_state(tiny_models[name]), config, padded_vocab=1280)
    d = config.kv_channels
    assert megatron["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * d, 64)
    assert megatron["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 128, 64)
    embedding = megatron["embedding.word_embeddings.weight"]
    assert embedding.shape == (1280, 64)
    assert torch.count_nonzero(embedding[1000:]) == 0
    assert ("output_layer.weight" in megatron) == (not config.tie_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in megatron) == config.qkv_bias


def test_qkv_rows_are_grouped_per_kv_head():
    # 4 query heads, 2 kv heads, head_dim 1: label every row with where it came from.
    config = ModelConfig(hidden=4, layers=1, heads=4, kv_heads=2, ffn_hidden=8, vocab=8, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, config)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, config), (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], config)
    assert bias.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


@pytest.mark.parametrize("name", list(TINY))
def test_hf_config_round_trip(tiny_models, name):
    original = read_hf_config(tiny_models[name])
    config = model_config_from_hf(original)
    with_base = hf_config_from_model_config(config, original, original["dtype"])
    assert with_base == original
    fresh = hf_config_from_model_config(config)  # no source config: transformers' defaults
    assert model_config_from_hf(fresh) == config


def test_fresh_hf_config_loads_in_transformers(tmp_path):
    from transformers import AutoConfig

    config = get_preset("qwen2.5-0.5b")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model_config(config)))
    loaded = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert model_config_from_hf(loaded.to_dict()) == config


def test_smollm2_preset_matches_its_hf_config():
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
          "vocab_size": 49152, "max_position_embeddings": 8192, "head_dim": 64,
          "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu"}
    assert model_config_from_hf(hf) == get_preset("smollm2-135m")
    # transformers 4.x spelling of the rotary base
    old = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 100000.0}
    assert model_config_from_hf(old) == get_preset("smollm2-135m")


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(UserError) as error:
        detect_family({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    message = str(error.value)
    assert "GPT2LMHeadModel" in message and supported_architectures() in message
    for family in ("Llama", "Qwen2", "Mistral"):
        assert family in message


@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_features_megatron_would_compute_differently_are_refused(tiny_models, change, words):
    config = read_hf_config(tiny_models["llama_tied"]) | change
    with pytest.raises(UserError, match=words):
        model_config_from_hf(config)


def test_missing_or_unexpected_tensors_are_named(tiny_models):
    state = hf_state(tiny_models["mistral_untied"])
    config = model_config_from_hf(read_hf_config(tiny_models["mistral_untied"]))
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight"):
        check_hf_names({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
                       config)
    with pytest.raises(UserError, match="o_proj.bias"):
        check_hf_names({**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, config)
    # harmless extras: the rotary buffer of old checkpoints
    check_hf_names({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}, config)


def test_tied_checkpoint_that_also_stores_lm_head(tiny_models):
    state = hf_state(tiny_models["llama_tied"])
    config = model_config_from_hf(read_hf_config(tiny_models["llama_tied"]))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    check_hf_names(state, config)
    assert "output_layer.weight" not in hf_to_megatron(state, config)


def test_pytorch_bin_and_sharded_safetensors_read_the_same(tiny_models, tmp_path):
    from logra_megatron.convert.hf_io import write_hf_weights

    state = hf_state(tiny_models["qwen2_tied"])
    config_text = open(os.path.join(tiny_models["qwen2_tied"], "config.json")).read()
    for folder in ("bin", "sharded"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(config_text)
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    files = write_hf_weights(state, str(tmp_path / "sharded"), max_shard_bytes=60_000)
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    for folder in ("bin", "sharded"):
        weights = HFWeights(str(tmp_path / folder))
        assert sorted(weights) == sorted(state)
        assert all(torch.equal(weights[k], state[k]) for k in state)


def test_transformer_engine_norm_names_are_understood(tiny_models):
    # On CUDA the TE layer spec names the norms after the linear they are fused into.
    from logra_megatron.convert.hf import MegatronView

    state = hf_state(tiny_models["qwen2_tied"])
    config = model_config_from_hf(read_hf_config(tiny_models["qwen2_tied"]))
    local = hf_to_megatron(state, config)
    te_names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    renamed = {}
    for name, tensor in local.items():
        for old, new in te_names.items():
            name = name.replace(old, new)
        renamed[name] = tensor
    view = MegatronView(state, config, config.padded_vocab(1))
    te_name = "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert te_name in view
    assert torch.equal(view[te_name], local["decoder.layers.1.pre_mlp_layernorm.weight"])
    back = megatron_to_hf(renamed, config)
    assert all(torch.equal(back[k], state[k]) for k in state)
