"""``get_dense_optimizer``: Megatron's own optimizer for the whole model (``get_megatron_optimizer``),
inside :class:`~logra_megatron.optim.controlled.ControlledOptimizer` so the KL controller drives
dense Adam exactly as it drives LoGRA (its step is Megatron's, to the bit)."""

from typing import List

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from logra_megatron.optim.controlled import ControlledOptimizer
from logra_megatron.optim.megatron_internals import flatten_chain


def get_dense_optimizer(config: OptimizerConfig, model_chunks: List) -> ControlledOptimizer:
    model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return ControlledOptimizer(model_chunks, flatten_chain(get_megatron_optimizer(config, model_chunks)))
