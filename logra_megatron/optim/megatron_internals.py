"""The private members of megatron-core's optimizers that this package reads or calls, in one place.

Read from megatron-core 0.16.1 (``megatron/core/optimizer/optimizer.py``,
``megatron/core/optimizer/distrib_optimizer.py``). Megatron offers no public way to:

- name the fp32 *main* parameters an optimizer updates (the KL controller keeps copies of them
  around a proposed step, and previews an interpolation of the two);
- publish the main parameters to the model's parameters outside of its own ``step`` (what a
  preview and an undone step need: Megatron does it at the end of ``step_with_ready_grads``);
- load a distributed optimizer's checkpoint at another layout with torch's Adam (no Apex or
  Transformer Engine), which megatron-core 0.16.1 cannot do as it stands (see
  :func:`loading_distributed_adam_state`).

Everything else (grad norm, clip, zero counts, state dicts, ``reload_model_params``) goes
through the public ``MegatronOptimizer`` API. When megatron-core is upgraded, this file is the
one to re-read.
"""

import contextlib
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


def publish_main_params(optimizer: MegatronOptimizer, defer_gather: bool = False) -> None:
    """Main parameters -> model parameters, as Megatron does at the end of its step (a copy,
    and under the distributed optimizer the all-gather of every rank's shard). ``defer_gather``
    with ``--overlap-param-gather``: as Megatron's own step does, leave the all-gather to the next
    forward's pre-hooks, bucket by bucket beside the compute; they gather a bucket group only while
    it is not marked dispatched (``param_gather_dispatched``, read from megatron-core 0.16.1
    ``param_and_grad_buffer.py``), so the mark is cleared here."""
    if isinstance(optimizer, (DistributedOptimizer, Float16OptimizerWithFloat16Params)):
        optimizer._copy_main_params_to_model_params()
    if isinstance(optimizer, DistributedOptimizer):
        for chunk in optimizer.model_chunks:
            if defer_gather and chunk.ddp_config.overlap_param_gather:
                for group in chunk.bucket_groups:
                    group.param_gather_dispatched = False
            else:
                chunk.start_param_sync(force_sync=True)


DISTRIBUTED_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The ``metadata`` of ``sharded_state_dict`` that lays out the distributed optimizer's state
(``--use-distributed-optimizer``) per parameter, like a plain optimizer's (gathered over DP on
the save), so that it loads at any TP/PP/DP: Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``.
megatron-core's default (``fully_sharded_model_space``) is refused by its own ``ShardedTensor``
("flattened_range is not supported"), and ``dp_reshardable`` reshards over DP only. The other
optimizers ignore it."""


@contextlib.contextmanager
def loading_distributed_adam_state(optimizer: MegatronOptimizer):
    """Around building a load request for ``optimizer``'s checkpoint (with
    :data:`DISTRIBUTED_CHECKPOINT_METADATA`) and its ``load_state_dict``: three gaps of
    megatron-core 0.16.1's distributed optimizer over torch's Adam are filled.

    - Its ``state_dict`` (part of the request) reads every parameter's Adam ``step``, which a
      fresh optimizer has none of (an assertion), and its ``load_state_dict`` would allocate the
      missing state on ``torch.cuda.current_device()``: the state is allocated first (zero
      moments, step 0; the checkpoint overwrites them). A state already there is kept.
    - Its fully reshardable loader copies every key of a parameter's Adam state from tensors it
      built without ``step`` (restored separately, from the param groups): a ``KeyError``. The
      copy here sees the state without ``step``.
    - It gives every parameter's state the same ``step`` tensor, which torch's Adam increments in
      place once per parameter: each gets its own.
    """
    parts = [part for part in flatten_chain(optimizer) if isinstance(part, DistributedOptimizer)]
    for part in parts:
        inner = part.optimizer
        for group in inner.param_groups:
            # torch's own placement of ``step``: on the parameter's device when fused or
            # capturable, else a CPU scalar.
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(
                        step=torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
                        exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        part._set_main_param_and_optimizer_states = _without_step(part, part._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for part in parts:
            del part._set_main_param_and_optimizer_states  # the class's method again
            for state in part.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def _without_step(part: DistributedOptimizer, original):
    def set_states(model_param, tensors):
        group_index, group_order = part.model_param_group_index_map[model_param]
        state = part.optimizer.state[part.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return set_states
