"""The private members of megatron-core's optimizers that this package reads or calls, in one place.

Read from megatron-core 0.16.1 (``megatron/core/optimizer/optimizer.py``,
``megatron/core/optimizer/distrib_optimizer.py``). Megatron offers no public way to:

- name the fp32 *main* parameters an optimizer updates (the KL controller keeps copies of them
  around a proposed step, and previews an interpolation of the two);
- publish the main parameters to the model's parameters outside of its own ``step`` (what a
  preview and an undone step need: Megatron does it at the end of ``step_with_ready_grads``).

Everything else (grad norm, clip, zero counts, state dicts, ``reload_model_params``) goes
through the public ``MegatronOptimizer`` API. When megatron-core is upgraded, this file is the
one to re-read.
"""

from typing import List

import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

MEGATRON_CORE_VERSION_READ = "0.16.1"


def flatten_chain(optimizer: MegatronOptimizer) -> List[MegatronOptimizer]:
    """The non-chained optimizers inside ``optimizer`` (itself when it is not a chain)."""
    if isinstance(optimizer, ChainedOptimizer):
        return [inner for part in optimizer.chained_optimizers for inner in flatten_chain(part)]
    return [optimizer]


def main_param_groups(optimizer: MegatronOptimizer) -> List[List[torch.nn.Parameter]]:
    """The groups of fp32 tensors ``optimizer`` updates: Megatron's fp32 masters of 16-bit
    parameters (this rank's shard under the distributed optimizer) and its fp32 parameters."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.shard_fp32_from_float16_groups + optimizer.shard_fp32_groups
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return optimizer.fp32_from_float16_groups + optimizer.fp32_from_fp32_groups
    return [group["params"] for group in optimizer.optimizer.param_groups]  # FP32Optimizer


def master_param_groups(optimizer: MegatronOptimizer) -> List[List[torch.nn.Parameter]]:
    """The fp32 master copies ``optimizer`` holds of 16-bit parameters (none for fp32 models)."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.shard_fp32_from_float16_groups
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return optimizer.fp32_from_float16_groups
    return []


def publish_main_params(optimizer: MegatronOptimizer) -> None:
    """Main parameters -> model parameters, as Megatron does at the end of its step (a copy,
    and under the distributed optimizer the all-gather of every rank's shard)."""
    if isinstance(optimizer, (DistributedOptimizer, Float16OptimizerWithFloat16Params)):
        optimizer._copy_main_params_to_model_params()
    if isinstance(optimizer, DistributedOptimizer):
        for chunk in optimizer.model_chunks:
            chunk.start_param_sync(force_sync=True)
