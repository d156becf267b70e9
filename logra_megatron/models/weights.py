"""Full (TP=1, PP=1) tensors <-> this rank's shards, for weights and gradients.

A rank holds its pipeline stage's layers (numbered locally from 0) and, for tensor-parallel
parameters, one slice along ``param.partition_dim``. These helpers translate both ways with
global layer names, so tests can compare any layout against TP=1 and tools can load a full
state dict at any layout. One subtlety: the SwiGLU ``linear_fc1`` weight of a TP rank is
``[gate_k; up_k]``, so the full ``[gate; up]`` matrix is split (and gathered) per half.
"""

import re

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.seeding import name_seed

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


def layer_offset(model) -> int:
    """Global index of this model chunk's first transformer layer (Megatron's own placement,
    virtual pipeline stages included)."""
    # megatron-core is loaded here only: this module is also imported where no model exists.
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))


def global_name(local_name: str, offset: int) -> str:
    """``decoder.layers.<i>.x`` (stage-local) -> ``decoder.layers.<i + offset>.x``."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    return f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"


def is_swiglu_fc1(name: str) -> bool:
    """True for the SwiGLU ``linear_fc1`` weight or bias, whose TP shard is ``[gate_k; up_k]``
    (so it is split and gathered per half)."""
    return name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias")


def shard_of(full: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """This TP rank's slice of the full tensor for ``param`` (unchanged if not TP-split)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, rank, size = param.partition_dim, parallel.tp_rank(), parallel.tp_size()
    if is_swiglu_fc1(name):
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(gate, size, dim)[rank], torch.chunk(up, size, dim)[rank]], dim)
    return torch.chunk(full, size, dim=dim)[rank]


def global_indices(param: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    """For each index of this rank's shard of ``param`` along ``dim``, its index in the full
    (TP=1) tensor: a TP-split dimension is offset by the rank's slice (per half for the SwiGLU
    ``linear_fc1``), any other dimension maps to itself."""
    local = param.shape[dim]
    device = param.device
    if not getattr(param, "tensor_model_parallel", False) or param.partition_dim != dim:
        return torch.arange(local, device=device)
    rank, size = parallel.tp_rank(), parallel.tp_size()
    if is_swiglu_fc1(name):
        half = local // 2
        block = torch.arange(rank * half, (rank + 1) * half, device=device)
        return torch.cat([block, block + half * size])
    return torch.arange(rank * local, (rank + 1) * local, device=device)


def gather_full(local: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """The full tensor assembled from every TP rank's ``local`` slice (collective over TP)."""
    if not getattr(param, "tensor_model_parallel", False) or parallel.tp_size() == 1:
        return local.detach().clone()
    dim = param.partition_dim
    pieces = [torch.empty_like(local) for _ in range(parallel.tp_size())]
    dist.all_gather(pieces, local.detach().contiguous(), group=parallel.tp_group())
    if is_swiglu_fc1(name):
        gates, ups = zip(*(torch.chunk(p, 2, dim=dim) for p in pieces))
        return torch.cat([torch.cat(gates, dim), torch.cat(ups, dim)], dim)
    return torch.cat(pieces, dim=dim)


def full_state(model, what: str = "param", include=None) -> dict:
    """Every parameter (``what="param"``) or its gradient (``"grad"``, read from ``.grad`` or
    Megatron DDP's ``.main_grad``) as full tensors under global names, on every rank.

    Collective over TP and PP. With tied embeddings the last stage's copy of the embedding
    (``output_layer.weight``) is left out, as in a TP=1, PP=1 model. ``include(param)``, when
    given, picks the parameters to gather (the same ones on every rank of a TP group).
    """
    offset = layer_offset(model)
    mine = {}
    for name, param in model.named_parameters():
        if include is not None and not include(param):
            continue
        name = name.removeprefix("module.")
        if what == "param":
            tensor = param
        else:
            tensor = getattr(param, "main_grad", None)
            if tensor is None:
                tensor = param.grad
            if tensor is None:
                tensor = torch.zeros_like(param)
        full = gather_full(tensor, param, name)
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            continue
        mine[global_name(name, offset)] = full
    return merge_stages(mine)


def merge_stages(mine: dict) -> dict:
    """Every pipeline stage's ``mine`` (a dict under global names) merged into one, on every
    rank. Collective over PP."""
    if parallel.pp_size() == 1:
        return mine
    stages = [None] * parallel.pp_size()
    dist.all_gather_object(stages, mine, group=parallel.pp_group())
    merged = {}
    for stage in stages:
        merged.update(stage)
    return merged


@torch.no_grad()
def load_full_state(model, state: dict) -> None:
    """Copy full tensors (global names, TP=1 layout) into this rank's parameters."""
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        key = global_name(name, offset)
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            key = "embedding.word_embeddings.weight"
        if key not in state:
            raise KeyError(f"state has no tensor for {key}")
        param.copy_(shard_of(state[key], param, name))


@torch.no_grad()
def initialize_layout_independent(model, vocab_size: int, seed: int, init_std: float = 0.02) -> None:
    """Re-initialize every parameter from generators seeded by (seed, global name), drawing the
    full TP=1 tensor and keeping this rank's shard, so a fresh model has the same weights at
    every TP/PP layout (Megatron's own init depends on the layout: pipeline stages restart the
    generator, SwiGLU fc1 and the padded vocabulary are split differently).

    Each full tensor is drawn on the parameter's device, one at a time (:func:`fresh_full_tensor`).
    Every rank draws full tensors: meant for fresh (non-pretrained) models; pretrained ones are
    loaded from checkpoints.
    """
    offset = layer_offset(model)
    for local_name, param in model.named_parameters():
        local_name = local_name.removeprefix("module.")
        name = global_name(local_name, offset)
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            name = "embedding.word_embeddings.weight"
        param.copy_(fresh_shard(param, local_name, name, vocab_size, seed, init_std, model.config.num_layers))


def fresh_shard(param: torch.Tensor, local_name: str, name: str, vocab_size: int, seed: int, init_std: float,
                num_layers: int) -> torch.Tensor:
    """This rank's shard of the fresh full tensor ``name`` (global name) for ``param`` (its TP
    split read from the parameter's attributes), in the parameter's dtype, on its device."""
    full_shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        full_shape[param.partition_dim] *= parallel.tp_size()
    full = fresh_full_tensor(name, full_shape, vocab_size, seed, init_std, num_layers, param.device)
    # The shard is copied out so the full tensor goes now: one at a time (a 32B model's largest is a few GiB).
    return shard_of(full, param, local_name).to(param.dtype, copy=True)


def fresh_full_tensor(name: str, full_shape, vocab_size: int, seed: int, init_std: float, num_layers: int,
                      device) -> torch.Tensor:
    """The fresh fp32 value of the full (TP=1) tensor ``name`` (a global name), drawn on ``device``.

    Normal(0, init_std) for matrices, scaled by 1/sqrt(2 layers) for the residual-branch outputs
    (linear_proj, linear_fc2) as in Megatron; ones for norms, zeros for biases; vocabulary
    padding rows are zero. The generator is seeded by (seed, name) and lives on ``device``: on a
    GPU the draw runs there (a 7B model's weights in seconds, not the minutes one CPU generator
    takes). Its stream is that device kind's own, so CPU and CUDA weights differ; every layout
    on one device kind agrees.
    """
    if len(full_shape) == 1:
        fill = torch.ones if "norm" in name else torch.zeros
        return fill(full_shape, device=device)
    std = init_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = init_std / (2.0 * num_layers) ** 0.5
    generator = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = torch.zeros(full_shape, device=device)
        full[:vocab_size] = torch.randn(vocab_size, full_shape[1], generator=generator, device=device) * std
        return full
    return torch.randn(full_shape, generator=generator, device=device) * std
