"""RMSNorm for Megatron's sequence parallelism without Transformer Engine or Apex.

Under sequence parallelism each tensor-parallel rank normalizes its own slice of the sequence, so
the norm's weight gradient on one rank covers only that slice: the TP ranks' gradients must be
summed. Megatron's ``finalize_model_grads`` sums every parameter tagged ``sequence_parallel``;
Transformer Engine's and Apex's norms carry that tag, torch's do not, which is why megatron-core's
``WrappedTorchNorm`` refuses sequence parallelism outright. This norm is torch's RMSNorm with the
tag, so the local layer spec runs with ``--sequence-parallel`` on any machine.
"""

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built from Megatron's norm arguments, its weight tagged for the TP
    all-reduce of sequence-parallel gradients."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm; the config asks for {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


# The block-level norms of the local layer spec that see the sequence-parallel activations (q/k
# norms work on heads after the gather and are left as they are).
_LAYER_NORM_SLOTS = ("input_layernorm", "pre_mlp_layernorm")


def sequence_parallel_block_spec(config, layer_spec: ModuleSpec, vp_stage=None) -> ModuleSpec:
    """The transformer block spec for ``layer_spec`` under sequence parallelism: the layer's and
    the block's final torch norms replaced by :class:`SequenceParallelRMSNorm`. A spec whose
    norms are not torch's (Transformer Engine's) is only wrapped into its block."""
    layer_spec = copy.deepcopy(layer_spec)
    for slot in _LAYER_NORM_SLOTS:
        if getattr(layer_spec.submodules, slot, None) is WrappedTorchNorm:
            setattr(layer_spec.submodules, slot, SequenceParallelRMSNorm)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelRMSNorm))
