"""DenseOptimizer: Megatron's optimizer (what ``get_megatron_optimizer`` returns, chained or
not) behind the training optimizer protocol (:mod:`logra_megatron.training.optimizer`).

It is the ``--optimizer adam`` baseline, and LoGRA's optimizer of the dense remainder (the
parameters that are not sketched), for which it also offers Megatron's step in its phases
(``prepare_grads``, ``grad_norm``, ``clip_grads``, ``propose_with_ready_grads``).

A proposed step (for the KL controller) keeps two copies of the optimizer's *main* parameters,
the fp32 values it updates (Megatron's fp32 masters of bf16 parameters, or the fp32 parameters
themselves; this rank's shard under the distributed optimizer): before and after the step. A
preview at scale ``s`` sets the mains to ``lerp(before, after, s)`` and publishes them to the
model parameters as Megatron does after a step (copy, and the all-gather of the distributed
optimizer); ``lerp`` is exact at ``s = 0`` and ``s = 1``. The masters are never read back from
the (rounded) model parameters, so a controlled bf16 run keeps fp32 precision.
"""

from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from logra_megatron.platform import default_device
from logra_megatron.platform.phases import phase


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
        self._before = self._after = None  # the main parameters around a proposed step

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
        """Megatron's step, skipped (``(False, None, None)``, nothing changes) when a gradient is
        inf or NaN: Megatron checks only under fp16 loss scaling, so the grad norm (agreed over
        the model-parallel and, sharded, the data-parallel ranks) is checked here too."""
        self._before = self._after = None
        with phase("grad_norm"):
            grad_norm = self._checked_clipped_norm()
        if grad_norm is None:
            return False, None, None
        with phase("dense_step"):
            return self.megatron.step_with_ready_grads(), grad_norm, None

    def propose(self):
        """:meth:`step`, kept undoable (see the module docstring): returns ``(ok, grad_norm,
        num_zeros)``; the update is visible until :meth:`preview` or :meth:`commit` changes it."""
        self._before = self._after = None
        with phase("grad_norm"):
            grad_norm = self._checked_clipped_norm()
        if grad_norm is None:
            return False, None, None
        with phase("dense_step"):
            return self.propose_with_ready_grads(), grad_norm, None

    def _checked_clipped_norm(self):
        if self.prepare_grads() or self.grads_not_finite():
            return None
        grad_norm = self.grad_norm()
        clip = self._inner()[0].config.clip_grad
        if clip > 0.0:
            self.clip_grads(clip, grad_norm)
        return grad_norm

    def preview(self, scale: float) -> None:
        """The model parameters at ``before + scale * (after - before)`` (the mains too)."""
        if self._before is None:
            return
        for main, before, after in zip(self._mains(), self._before, self._after):
            torch.lerp(before, after, scale, out=main)
        self._publish()

    def commit(self, scale: float) -> None:
        """Keep ``before + scale * (after - before)``; drop the copies."""
        if self._before is None:
            return
        self.preview(scale)
        self._before = self._after = None

    def discard(self) -> None:
        """Drop a proposed step: the mains return to their copies from before it (copied, not
        interpolated, so an inf or NaN in the proposal cannot leak in)."""
        if self._before is None:
            return
        for main, before in zip(self._mains(), self._before):
            main.copy_(before)
        self._publish()
        self._before = self._after = None

    def diagnostics(self) -> Dict[str, float]:
        return {}

    def extra_bytes(self) -> int:
        """Bytes held for a proposed step (the before/after copies of the mains)."""
        copies = (self._before or []) + (self._after or [])
        return sum(t.numel() * t.element_size() for t in copies)

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

    def grads_not_finite(self) -> bool:
        """An inf or NaN in any main gradient on any rank (agreed by all of them). Megatron
        checks only under fp16 loss scaling; its grad norm cannot stand in, because it counts a
        tensor-parallel duplicate (a norm weight) on TP rank 0 only."""
        grads = [param.grad for inner in self._inner() for group in inner.optimizer.param_groups
                 for param in group["params"] if param.grad is not None]
        # One device-side reduction and one host sync, not one sync per tensor.
        finite = (torch.stack([torch.isfinite(grad).all() for grad in grads]).all() if grads
                  else torch.tensor(True, device=default_device()))
        flag = (~finite).float().reshape(1)  # on the grads' device (NCCL reduces device tensors)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank steps together
        return bool(flag.item() > 0)

    def grad_norm(self) -> float:
        return float(self.megatron.get_grad_norm() or 0.0)

    def clip_grads(self, max_norm: float, total_norm: float) -> None:
        for inner in self._inner():
            params = inner.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm, total_norm)

    def step_with_ready_grads(self) -> bool:
        self._before = self._after = None
        return self.megatron.step_with_ready_grads()

    def propose_with_ready_grads(self) -> bool:
        """:meth:`propose` after ``prepare_grads`` / ``grad_norm`` / ``clip_grads``."""
        before = self._copy_mains()
        success = self.megatron.step_with_ready_grads()
        self._before, self._after = before, self._copy_mains()
        return success

    # --- main parameters --------------------------------------------------------------------------

    def _mains(self) -> List[torch.Tensor]:
        """The fp32 tensors the inner optimizers update, in a fixed order."""
        mains = []
        for inner in self._inner():
            if isinstance(inner, DistributedOptimizer):
                groups = inner.shard_fp32_from_float16_groups + inner.shard_fp32_groups
            elif isinstance(inner, Float16OptimizerWithFloat16Params):
                groups = inner.fp32_from_float16_groups + inner.fp32_from_fp32_groups
            else:  # FP32Optimizer: the parameters themselves
                groups = [group["params"] for group in inner.optimizer.param_groups]
            mains.extend(p.data for group in groups for p in group)
        return mains

    def _copy_mains(self) -> List[torch.Tensor]:
        return [main.detach().clone() for main in self._mains()]

    def _publish(self) -> None:
        """Mains -> model parameters, as Megatron does after its step."""
        for inner in self._inner():
            if isinstance(inner, (DistributedOptimizer, Float16OptimizerWithFloat16Params)):
                inner._copy_main_params_to_model_params()
            if isinstance(inner, DistributedOptimizer):
                for chunk in inner.model_chunks:
                    chunk.start_param_sync(force_sync=True)
