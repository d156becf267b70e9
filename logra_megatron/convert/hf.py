"""Hugging Face Llama / Qwen2 / Mistral <-> our ModelConfig and Megatron's full state dict.

These are pure functions over plain dicts and tensors, so every mapping is testable in one
process without torch.distributed. The Megatron side uses full (TP=1, PP=1) tensors under
global names, the format :mod:`logra_megatron.models.weights` shards onto any layout.

The two layouts differ in four places:

* Attention projections. HF keeps ``q_proj``, ``k_proj``, ``v_proj``; Megatron fuses them into
  one ``linear_qkv`` whose rows are grouped per key/value head: for every query group, the rows
  of its ``heads / kv_heads`` query heads, then its key head, then its value head. Grouping
  this way lets a tensor-parallel split of the rows hand each rank whole groups.
* MLP. HF's ``gate_proj`` and ``up_proj`` become one ``linear_fc1`` = ``[gate; up]``.
* Vocabulary. Megatron pads the vocabulary so every TP rank holds an equal slice; the padding
  rows of the embedding and output layer are zeros here and are dropped on the way back.
* Tied embeddings. HF may or may not store ``lm_head.weight`` for a tied model; Megatron's full
  state has only the embedding (the last pipeline stage's copy is filled from it).

Rotary embeddings need no permutation: HF's Llama-family checkpoints and Megatron's
``rotary_interleaved=False`` both rotate the two halves of each head.
"""

import re
from collections.abc import Mapping
from typing import Iterable, Optional

import torch

from logra_megatron.errors import UserError
from logra_megatron.models.config import ModelConfig

# family -> HF architecture class name, in the order error messages list them.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
_FAMILY_TITLES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}

# HF tensors that carry no weights of ours and may be dropped silently (old checkpoints saved
# the rotary frequency buffer).
_IGNORABLE_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def supported_architectures() -> str:
    """``Llama (LlamaForCausalLM), Qwen2 (...), Mistral (...)`` for error messages."""
    return ", ".join(f"{_FAMILY_TITLES[f]} ({a})" for f, a in ARCHITECTURES.items())


# --- configuration --------------------------------------------------------------------------

def detect_family(hf_config: dict) -> str:
    """``llama``, ``qwen2`` or ``mistral`` from an HF ``config.json``; a :class:`UserError`
    naming the supported architectures otherwise."""
    architectures = hf_config.get("architectures") or []
    for family, architecture in ARCHITECTURES.items():
        if architecture in architectures:
            return family
    model_type = hf_config.get("model_type")
    if not architectures and model_type in ARCHITECTURES:
        return model_type
    found = architectures[0] if architectures else (model_type or "unknown")
    raise UserError(
        f"unsupported architecture {found!r}; supported: {supported_architectures()}"
    )


def _rope(hf_config: dict) -> float:
    """The rotary base; a :class:`UserError` for rotary variants Megatron is not built with."""
    params = hf_config.get("rope_parameters") or {}
    if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise UserError("per-layer-type rope_parameters are not supported; the model family "
                        "uses one rotary embedding for every layer")
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UserError(f"rope scaling {rope_type!r} is not supported; only plain rotary "
                        f"embeddings (rope_type 'default') convert")
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise UserError(f"rope_theta {theta} is not an integer, which Megatron's rotary_base needs")
    return float(theta)


def _require(hf_config: dict, key: str):
    if hf_config.get(key) is None:
        raise UserError(f"config.json has no {key!r}")
    return hf_config[key]


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """Our :class:`ModelConfig` for an HF ``config.json`` dict.

    Raises a :class:`UserError` for anything the Megatron model would compute differently:
    another architecture, an activation other than SiLU, biases other than Qwen2's QKV bias,
    rotary scaling.
    """
    family = detect_family(hf_config)
    activation = hf_config.get("hidden_act", "silu")
    if activation != "silu":
        raise UserError(f"hidden_act {activation!r} is not supported; the model family uses silu")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise UserError("attention_bias / mlp_bias on every projection is not supported; only "
                        "Qwen2's bias on the query/key/value projections converts")
    heads = _require(hf_config, "num_attention_heads")
    hidden = _require(hf_config, "hidden_size")
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the default; keeps configs equal to the presets
    return ModelConfig(
        hidden=hidden,
        layers=_require(hf_config, "num_hidden_layers"),
        heads=heads,
        kv_heads=hf_config.get("num_key_value_heads") or heads,
        ffn_hidden=_require(hf_config, "intermediate_size"),
        vocab=_require(hf_config, "vocab_size"),
        max_seq=hf_config.get("max_position_embeddings") or 2048,
        rope_theta=_rope(hf_config),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        head_dim=head_dim,
        family=family,
    )


def sliding_window_note(hf_config: dict) -> Optional[str]:
    """A one-line note when the HF model uses sliding-window attention (Megatron's model here
    attends to the whole causal prefix, so the two agree only up to the window length)."""
    window = hf_config.get("sliding_window")
    uses_window = hf_config.get("use_sliding_window", hf_config.get("model_type") == "mistral")
    if not window or not uses_window:
        return None
    if window >= (hf_config.get("max_position_embeddings") or 0):
        return None
    return (f"note: sliding-window attention (window {window}) is not modelled; the converted "
            f"model matches the original on sequences of up to {window} tokens")


def hf_config_from_model_config(model: ModelConfig, base: Optional[dict] = None,
                                dtype: str = "float32") -> dict:
    """An HF ``config.json`` dict for ``model``.

    ``base`` (the original model's config, when known) keeps fields we do not model, such as
    token ids; without it transformers' defaults for the family fill them in.
    """
    values = dict(
        architectures=[ARCHITECTURES[model.family]],
        model_type=model.family,
        hidden_size=model.hidden,
        intermediate_size=model.ffn_hidden,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.kv_channels,
        vocab_size=model.vocab,
        max_position_embeddings=model.max_seq,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        hidden_act="silu",
    )
    if model.family == "llama":
        values.update(attention_bias=False, mlp_bias=False)
    if base is None:
        from transformers import AutoConfig

        settings = {k: v for k, v in values.items() if k != "model_type"}
        base = AutoConfig.for_model(model.family, **settings).to_dict()
        base.pop("transformers_version", None)
    config = dict(base)
    if "head_dim" not in config and model.head_dim is None:
        del values["head_dim"]  # the family's default; Qwen2 configs do not spell it out
    config.update(values)
    if "rope_theta" in config and "rope_parameters" not in config:
        config["rope_theta"] = model.rope_theta
    else:
        config["rope_parameters"] = {**(config.get("rope_parameters") or {}),
                                     "rope_theta": model.rope_theta, "rope_type": "default"}
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    return config


# --- tensor names ---------------------------------------------------------------------------

def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def megatron_names(model: ModelConfig) -> list:
    """Every full Megatron parameter name (global layer numbers), as ``full_state`` lists them."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(model.layers):
        layer = _mc_layer(i)
        names += [layer + "input_layernorm.weight",
                  layer + "self_attention.linear_proj.weight",
                  layer + "self_attention.linear_qkv.weight"]
        if model.qkv_bias:
            names.append(layer + "self_attention.linear_qkv.bias")
        names += [layer + "pre_mlp_layernorm.weight",
                  layer + "mlp.linear_fc1.weight",
                  layer + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not model.tie_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names(model: ModelConfig) -> list:
    """Every HF tensor name of ``model`` (without ``lm_head.weight`` when tied)."""
    names = ["model.embed_tokens.weight"]
    for i in range(model.layers):
        layer = _hf_layer(i)
        names.append(layer + "input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(layer + f"self_attn.{proj}.weight")
            if model.qkv_bias:
                names.append(layer + f"self_attn.{proj}.bias")
        names += [layer + "self_attn.o_proj.weight",
                  layer + "post_attention_layernorm.weight",
                  layer + "mlp.gate_proj.weight",
                  layer + "mlp.up_proj.weight",
                  layer + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not model.tie_embeddings:
        names.append("lm_head.weight")
    return names


def check_hf_names(names: Iterable[str], model: ModelConfig) -> None:
    """A :class:`UserError` if the HF checkpoint lacks a tensor ``model`` needs or holds one
    this conversion would drop (a bias the family does not have, an extra layer, ...)."""
    names = set(names)
    expected = set(hf_names(model))
    missing = sorted(expected - names)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"the checkpoint has no tensor {missing[0]}{more}; it does not match its "
                        f"config.json ({model.family}, {model.layers} layers)")
    unexpected = sorted(n for n in names - expected
                        if not _IGNORABLE_HF.search(n)
                        and not (n == "lm_head.weight" and model.tie_embeddings))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise UserError(f"the checkpoint has tensor {unexpected[0]}{more} that a {model.family} "
                        f"model does not use; converting would drop it")


# --- HF -> Megatron -------------------------------------------------------------------------

def pad_vocab_rows(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """``weight`` ([vocab, hidden]) with zero rows appended up to ``padded_vocab`` rows."""
    extra = padded_vocab - weight.shape[0]
    if extra < 0:
        raise ValueError(f"padded vocab {padded_vocab} is smaller than the vocab {weight.shape[0]}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Megatron's ``linear_qkv`` weight (or bias) from HF's q/k/v: per query group, the group's
    query heads, then its key head, then its value head."""
    groups = model.kv_heads
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest),
                       v.reshape(groups, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, model: ModelConfig):
    """Inverse of :func:`fuse_qkv`: ``(q, k, v)`` in HF's layout."""
    groups, d = model.kv_heads, model.kv_channels
    per_group = model.heads // model.kv_heads * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2 * d, *rest)
    q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, for the one-to-one tensors.
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


# Transformer Engine's layer spec (on CUDA) fuses each RMSNorm into the following linear; its
# parameters then carry these names instead of the local spec's.
_TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def canonical_name(name: str) -> str:
    """The local-spec name of a Megatron parameter (Transformer Engine's fused-norm names are
    renamed, every other name is returned unchanged)."""
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in _TE_NORM_NAMES:
        return f"{_mc_layer(int(match.group(1)))}{_TE_NORM_NAMES[match.group(2)]}"
    return name


def megatron_tensor(name: str, hf: Mapping, model: ModelConfig, padded_vocab: int) -> torch.Tensor:
    """One full Megatron tensor, built from the HF tensors it comes from.

    ``hf`` is any mapping from HF names to tensors; only the tensors this one needs are read,
    so a lazily loading mapping keeps the memory of a conversion to one stage's tensors.
    """
    name = canonical_name(name)
    if name == "embedding.word_embeddings.weight":
        return pad_vocab_rows(hf["model.embed_tokens.weight"], padded_vocab)
    if name == "output_layer.weight":
        return pad_vocab_rows(hf["lm_head.weight"], padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    match = _LAYER_NAME.match(name)
    if match is None:
        raise KeyError(f"no HF source for Megatron tensor {name}")
    layer, suffix = _hf_layer(int(match.group(1))), match.group(2)
    if suffix in _DIRECT:
        return hf[layer + _DIRECT[suffix]]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return fuse_qkv(*(hf[layer + f"self_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")),
                        model)
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]], dim=0)
    raise KeyError(f"no HF source for Megatron tensor {name}")


class MegatronView(Mapping):
    """The full Megatron state dict of an HF checkpoint, built tensor by tensor on access.

    Hand it to :func:`logra_megatron.models.weights.load_full_state`: a rank then reads only
    the HF tensors of its own pipeline stage. ``on_access`` (e.g. a progress bar's update) is
    called once per tensor built.
    """

    def __init__(self, hf: Mapping, model: ModelConfig, padded_vocab: int, on_access=None):
        self.hf, self.model, self.padded_vocab = hf, model, padded_vocab
        self.on_access = on_access
        self._names = megatron_names(model)
        self._known = set(self._names)

    def __getitem__(self, name):
        if name not in self:
            raise KeyError(name)
        tensor = megatron_tensor(name, self.hf, self.model, self.padded_vocab)
        if self.on_access is not None:
            self.on_access(name)
        return tensor

    def __contains__(self, name):
        return canonical_name(name) in self._known

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def hf_to_megatron(hf: Mapping, model: ModelConfig, padded_vocab: Optional[int] = None) -> dict:
    """The full Megatron state dict (global names, TP=1 layout) of an HF state dict.

    ``padded_vocab`` defaults to the TP=1 padding, ``model.padded_vocab(1)``.
    """
    if padded_vocab is None:
        padded_vocab = model.padded_vocab(1)
    return dict(MegatronView(hf, model, padded_vocab).items())


# --- Megatron -> HF -------------------------------------------------------------------------

def megatron_to_hf(state: Mapping, model: ModelConfig) -> dict:
    """HF tensors (names as ``save_pretrained`` writes them) from a full Megatron state dict.

    The vocabulary padding rows are dropped; with tied embeddings no ``lm_head.weight`` is
    written (HF ties it to the embedding on load). Transformer Engine's fused-norm names are
    accepted as well as the local spec's.
    """
    state = {canonical_name(name): tensor for name, tensor in state.items()}
    out = {}
    for name in megatron_names(model):
        out.update(hf_tensors(name, state[name], model))
    return out


def hf_tensors(name: str, tensor: torch.Tensor, model: ModelConfig) -> dict:
    """The HF tensors one full Megatron tensor becomes: ``linear_qkv`` splits into q/k/v and
    ``linear_fc1`` into gate/up, the embedding and output layer lose their vocabulary padding
    rows, every other tensor is renamed.

    Only the rows are rearranged, so ``tensor`` may have any number of columns: a low-rank
    factor laid out like the weight's rows (``U`` of ``W = U Q^T``) maps the same way
    (logra_megatron/rollout/policy_update.py)."""
    name = canonical_name(name)
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": tensor[: model.vocab].contiguous()}
    if name == "output_layer.weight":
        return {"lm_head.weight": tensor[: model.vocab].contiguous()}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": tensor.contiguous()}
    match = _LAYER_NAME.match(name)
    if match is None:
        raise KeyError(f"no HF name for Megatron tensor {name}")
    layer, suffix = _hf_layer(int(match.group(1))), match.group(2)
    if suffix in _DIRECT:
        return {layer + _DIRECT[suffix]: tensor.contiguous()}
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, model)
        return {layer + f"self_attn.q_proj.{kind}": q, layer + f"self_attn.k_proj.{kind}": k,
                layer + f"self_attn.v_proj.{kind}": v}
    if suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return {layer + "mlp.gate_proj.weight": gate.contiguous(), layer + "mlp.up_proj.weight": up.contiguous()}
    raise KeyError(f"no HF name for Megatron tensor {name}")
