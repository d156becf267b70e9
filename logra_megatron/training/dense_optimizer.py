"""DenseOptimizer: Megatron's optimizer (what ``get_megatron_optimizer`` returns, chained or
not) behind the training optimizer protocol (:mod:`logra_megatron.training.optimizer`).

It is the ``--optimizer adam`` baseline, and LoGRA's optimizer of the dense remainder (the
parameters that are not sketched), for which it also offers Megatron's step in its phases
(``prepare_grads``, ``grad_norm``, ``clip_grads``, ``step_with_ready_grads``).
"""

from typing import Dict, List

import torch
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params


def _tensor_bytes(values) -> int:
    """Bytes of the tensors among ``values``, recursing into dicts (per-parameter state)."""
    total = 0
    for value in values:
        if torch.is_tensor(value):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += _tensor_bytes(value.values())
    return total


class DenseOptimizer:
    """``megatron_optimizer`` over the parameters of ``ddp_model`` (Megatron DDP, whose grad
    buffers the optimizer reads)."""

    def __init__(self, megatron_optimizer, ddp_model):
        self.megatron = megatron_optimizer
        self.ddp_model = ddp_model

    def _inner(self) -> List:
        """The underlying non-chained Megatron optimizers."""
        if isinstance(self.megatron, ChainedOptimizer):
            return list(self.megatron.chained_optimizers)
        return [self.megatron]

    # --- the training optimizer protocol --------------------------------------------------------

    @property
    def param_groups(self) -> List[dict]:
        return self.megatron.param_groups

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def step(self):
        return self.megatron.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.megatron.zero_grad(set_to_none)

    def reset_state(self) -> None:
        """Drop the Adam moments (and their step counts); torch's Adam creates them again,
        zeroed, at the next step. Weights and master weights are kept."""
        for inner in self._inner():
            inner.optimizer.state.clear()

    def state_bytes(self) -> Dict[str, int]:
        """Bytes allocated for the DDP gradient buffers, the optimizer state (after a step, so
        Adam's lazily created moments exist) and fp32 master weights (bf16/fp16 parameters)."""
        grad_bytes = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                         for buffer in self.ddp_model.buffers)
        state = master = 0
        for inner in self._inner():
            state += _tensor_bytes(inner.optimizer.state.values())
            if isinstance(inner, DistributedOptimizer):
                groups = inner.shard_fp32_from_float16_groups
            elif isinstance(inner, Float16OptimizerWithFloat16Params):
                groups = inner.fp32_from_float16_groups
            else:  # FP32Optimizer: the model's parameters are the master weights
                groups = []
            master += sum(p.numel() * p.element_size() for group in groups for p in group)
        return {"grad_bytes": grad_bytes, "optimizer_state_bytes": state,
                "master_weight_bytes": master, "projection_bytes": 0}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        return self.megatron.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state) -> None:
        self.megatron.load_state_dict(state)

    def reload_model_params(self) -> None:
        self.megatron.reload_model_params()

    # --- Megatron's step in phases (for LogRAOptimizer's dense remainder) ------------------------

    def prepare_grads(self) -> bool:
        """True when the gradients contain an inf or NaN (the step must be skipped)."""
        return self.megatron.prepare_grads()

    def grad_norm(self) -> float:
        return float(self.megatron.get_grad_norm() or 0.0)

    def clip_grads(self, max_norm: float, total_norm: float) -> None:
        for inner in self._inner():
            params = inner.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm, total_norm)

    def step_with_ready_grads(self) -> bool:
        return self.megatron.step_with_ready_grads()
