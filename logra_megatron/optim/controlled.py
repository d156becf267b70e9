"""ControlledOptimizer: Megatron's ``ChainedOptimizer`` with one gradient norm, one clip, and a step
that can be proposed, previewed and committed.

A Megatron-LM training loop drives it as it drives any ``MegatronOptimizer``: ``zero_grad``,
``scale_loss`` / ``get_loss_scale``, ``step() -> (update_successful, grad_norm,
num_zeros_in_grad)``, ``param_groups`` under ``OptimizerParamScheduler``, ``count_zeros``,
``get_parameters``, ``state_dict`` / ``load_state_dict``, ``sharded_state_dict`` for
``dist_checkpointing`` (each part's state under Megatron's ``chained_<i>.`` prefix), and
``reload_model_params``.

Its parts are Megatron's own dense optimizers (what ``get_megatron_optimizer`` builds) and, for
LoGRA, a low-rank part last (:class:`LowRankPart`, a ``MegatronOptimizer`` whose "gradient" is a
sketch rather than parameters' ``.grad``). Megatron's chain adds the parts' norms in quadrature
only when their statistics groups differ, and clips only ``get_parameters()``; here the global
norm is always ``sqrt(dense^2 + low_rank^2)`` (the low-rank part's norm may include an estimate
of the gradient outside its sketch), and both parts are clipped by that one norm.

The KL controller's protocol, on top of ``step``:

- ``propose()`` computes the step and commits nothing that cannot be undone: the dense parts
  step, keeping copies of their fp32 main parameters from before and after (see
  :mod:`~logra_megatron.optim.megatron_internals`); the low-rank part computes its update
  without applying it. Returns like ``step``.
- ``preview(scale)``: forward passes see ``W + scale * D`` (``scale = 0``: ``W``): dense mains at
  ``lerp(before, after, scale)`` published to the model (exact at 0 and 1; the masters are never
  read back from rounded model weights), the low-rank part through its own side path.
- ``commit(scale)`` keeps ``scale * D``; ``discard()`` returns to ``W`` (copied, not
  interpolated, so an inf or NaN in the proposal cannot leak in).

``step()`` is ``propose`` without the copies, then ``commit(1.0)``.
"""

import math
from typing import Dict, List, Optional, Protocol

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

from logra_megatron.optim.megatron_internals import main_param_groups, master_param_groups, publish_main_params
from logra_megatron.platform.phases import phase

STATE_BYTES_KEYS = ("grad_bytes", "optimizer_state_bytes", "master_weight_bytes", "projection_bytes")
"""The components of :meth:`ControlledOptimizer.state_bytes`."""


class LowRankPart(Protocol):
    """What :class:`ControlledOptimizer` needs of a low-rank part beyond ``MegatronOptimizer``
    (``prepare_grads`` reduces its gradient and says whether it is finite; ``get_grad_norm``
    is its part of the global norm; ``zero_grad``, state dicts as Megatron's)."""

    def clip_by(self, coefficient: float) -> None:
        """Scale the prepared gradient by ``coefficient`` (below 1)."""

    def propose_update(self) -> None:
        """Compute the step from the prepared gradient, applying nothing."""

    def preview(self, scale: float) -> None: ...

    def commit(self, scale: float) -> None: ...

    def discard(self) -> None: ...

    def reset_state(self) -> None: ...

    def state_bytes(self) -> Dict[str, int]: ...


def _tensor_bytes(values) -> int:
    """Bytes of the tensors among ``values``, recursing into dicts (per-parameter state)."""
    total = 0
    for value in values:
        if torch.is_tensor(value):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += _tensor_bytes(value.values())
    return total


class ControlledOptimizer(ChainedOptimizer):
    """``dense`` (Megatron's non-chained optimizers of ``model_chunks``, the Megatron DDP models)
    and an optional ``low_rank`` part, last."""

    def __init__(self, model_chunks: List, dense: List[MegatronOptimizer],
                 low_rank: Optional[MegatronOptimizer] = None):
        super().__init__(list(dense) + ([low_rank] if low_rank is not None else []))
        self.model_chunks = list(model_chunks)  # Megatron's inner optimizers do not all name theirs
        self.dense = list(dense)
        self.low_rank = low_rank
        self._before = self._after = None  # the dense main parameters around a proposed step
        self._proposed = False
        self.last_norms: Dict[str, float] = {}
        self.last_dense_sq = 0.0

    # --- Megatron's contract ----------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """Every part's parameters (Megatron's chain reaches for a single inner optimizer)."""
        return [param for part in self.chained_optimizers for param in part.get_parameters()]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global norm, ``sqrt(dense^2 + low_rank^2)``: the dense parts' gradients (TP
        duplicates and shared parameters counted once, over Megatron's statistics group) and the
        low-rank part's own norm."""
        dense_sq = self.last_dense_sq = self._dense_norm() ** 2
        low_rank_sq = float(self.low_rank.get_grad_norm()) ** 2 if self.low_rank is not None else 0.0
        return math.sqrt(dense_sq + low_rank_sq)

    def _dense_norm(self) -> float:
        live = [part for part in self.dense if not getattr(part, "is_stub_optimizer", False)]
        if not live:
            return 0.0
        if len(live) == 1:
            return float(live[0].get_grad_norm() or 0.0)
        grads = [grad for part in live for grad in part.get_main_grads_for_grad_norm()]
        return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=live[0].get_grad_stats_parallel_group()))

    @torch.no_grad()
    def count_zeros(self) -> float:
        zeros = sum(part.count_zeros() for part in self.dense)
        if self.low_rank is not None:
            zeros += self.low_rank.count_zeros()
        return zeros

    @torch.no_grad()
    def step(self):
        """Megatron's step: ``(update_successful, grad_norm, num_zeros_in_grad)``; skipped
        (``(False, None, None)``, nothing changes) on an inf or NaN gradient on any rank."""
        result = self.propose(undoable=False)
        if result[0]:
            self.commit(1.0)
        return result

    # --- the KL controller's protocol ---------------------------------------------------------------

    @torch.no_grad()
    def propose(self, undoable: bool = True):
        """The step, computed and held (see the module docstring); returns like :meth:`step`.
        With ``undoable=False`` the dense parts' step is final and no copies are kept."""
        self._before = self._after = None
        self._proposed = False
        found_inf = False
        if self.low_rank is not None:
            with phase("sketch_reduce"):
                found_inf = self.low_rank.prepare_grads()
        with phase("grad_norm"):
            found_inf = any([part.prepare_grads() for part in self.dense]) or found_inf
            # Megatron checks for inf/NaN only under fp16 loss scaling; its norm cannot stand
            # in, because it counts a TP duplicate (a norm weight) on TP rank 0 only.
            found_inf = self._dense_grads_not_finite() or found_inf
            grad_norm = None if found_inf else self.get_grad_norm()
        if grad_norm is None or not math.isfinite(grad_norm):
            if self.low_rank is not None:
                self.low_rank.discard()
            return False, None, None
        self.last_norms = {"grad_norm": grad_norm}
        clip = self.config.clip_grad
        if clip > 0.0:
            self._clip(clip, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        with phase("dense_step"):
            before = self._copy_mains() if undoable else None
            success = all([part.step_with_ready_grads() for part in self.dense])
            if undoable:
                self._before, self._after = before, self._copy_mains()
        if self.low_rank is not None:
            self.low_rank.propose_update()
        self._proposed = True
        return success, grad_norm, num_zeros

    def _clip(self, max_norm: float, total_norm: float) -> None:
        for part in self.dense:
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
        coefficient = max_norm / (total_norm + 1e-6)  # Megatron's clip_grad_by_total_norm_fp32
        if self.low_rank is not None and coefficient < 1.0:
            self.low_rank.clip_by(coefficient)

    def _dense_grads_not_finite(self) -> bool:
        """An inf or NaN in any dense main gradient on any rank (agreed by all of them)."""
        grads = [param.grad for part in self.dense for param in part.get_parameters() if param.grad is not None]
        device = grads[0].device if grads else self._device()
        # One device-side reduction and one host sync, not one sync per tensor.
        finite = torch.stack([torch.isfinite(grad).all() for grad in grads]).all() if grads else \
            torch.ones((), dtype=torch.bool, device=device)
        flag = (~finite).float().reshape(1)  # on the grads' device (NCCL reduces device tensors)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank steps together
        return bool(flag.item() > 0)

    def _device(self) -> torch.device:
        return next(self.model_chunks[0].parameters()).device

    def preview(self, scale: float) -> None:
        """Forward passes see ``W + scale * D`` of the proposed step."""
        if not self._proposed:
            return
        if self._before is not None:
            for main, before, after in zip(self._mains(), self._before, self._after):
                torch.lerp(before, after, scale, out=main)
            self._publish()
        if self.low_rank is not None:
            self.low_rank.preview(scale)

    @torch.no_grad()
    def commit(self, scale: float) -> None:
        """Keep ``scale`` times the proposed step; drop the copies."""
        if not self._proposed:
            return
        if self._before is not None:
            for main, before, after in zip(self._mains(), self._before, self._after):
                if scale != 1.0:
                    torch.lerp(before, after, scale, out=main)
                else:
                    main.copy_(after)
            self._publish(defer_gather=True)  # the next forward gathers (--overlap-param-gather)
        if self.low_rank is not None:
            self.low_rank.commit(scale)
        self._before = self._after = None
        self._proposed = False

    def discard(self) -> None:
        """Drop a proposed step: no weight, master or counter changes (the moments advanced by
        the step's gradient stay, as they do in :meth:`commit`)."""
        if self._before is not None:
            for main, before in zip(self._mains(), self._before):
                main.copy_(before)
            self._publish()
        if self.low_rank is not None:
            self.low_rank.discard()
        self._before = self._after = None
        self._proposed = False

    @torch.no_grad()
    def proposed_step_norm(self) -> Optional[float]:
        """The length of the proposed step ``D`` in weight space (None when nothing is proposed),
        agreed on every rank: the local squares summed over the whole world, so a parameter held
        on several ranks (TP duplicates, data-parallel replicas) counts once per holder. That is
        a constant factor per parameter for a given layout: the KL controller only compares
        the lengths of successive steps (its warm start), never the figure itself."""
        if not self._proposed:
            return None
        local = torch.zeros((), dtype=torch.float64, device=self._device())
        for square in self._step_squares():
            local += square.to(local.device, torch.float64)
        dist.all_reduce(local)
        return math.sqrt(float(local))

    def _step_squares(self) -> List[torch.Tensor]:
        """This rank's parts of ``||D||^2``: the dense mains' ``after - before`` (without the
        copies, under ``step()``, none), then the low-rank part's (:class:`LogRAOptimizer`)."""
        if self._before is None:
            return []
        return [torch.linalg.vector_norm(after - before, dtype=torch.float64) ** 2
                for before, after in zip(self._before, self._after)]

    def extra_bytes(self) -> int:
        """Bytes held only while a step is proposed (the dense parts' before/after copies)."""
        copies = (self._before or []) + (self._after or [])
        return sum(t.numel() * t.element_size() for t in copies)

    def diagnostics(self) -> Dict[str, float]:
        """Extra scalars of the last step (none for dense Adam; LoGRA's two gradient norms)."""
        return {}

    @property
    def kl_max_scale(self) -> float:
        """The KL controller's step-scale cap when ``--kl-max-scale`` is not given."""
        return float(getattr(self.low_rank, "kl_max_scale", 1.0))

    # --- state -----------------------------------------------------------------------------------------

    def reset_state(self) -> None:
        """Drop the moments and step counts, keep the weights: a new training phase starts from
        a clean optimizer (torch's Adam creates its moments again, zeroed, at the next step)."""
        for part in self.dense:
            part.optimizer.state.clear()
        if self.low_rank is not None:
            self.low_rank.reset_state()

    def state_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds by component (:data:`STATE_BYTES_KEYS`): DDP's gradient buffers,
        the optimizers' state (after a step: Adam's moments are created lazily), fp32 masters,
        and the low-rank part's own."""
        grad_bytes = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                         for chunk in self.model_chunks for buffer in chunk.buffers + chunk.expert_parallel_buffers)
        state = sum(_tensor_bytes(part.optimizer.state.values()) for part in self.dense)
        master = sum(p.numel() * p.element_size() for part in self.dense
                     for group in master_param_groups(part) for p in group)
        totals = {"grad_bytes": grad_bytes, "optimizer_state_bytes": state,
                  "master_weight_bytes": master, "projection_bytes": 0}
        if self.low_rank is not None:
            for key, value in self.low_rank.state_bytes().items():
                totals[key] += value
        return totals

    # --- dense main parameters ---------------------------------------------------------------------

    def _mains(self) -> List[torch.Tensor]:
        return [p.data for part in self.dense for group in main_param_groups(part) for p in group]

    def _copy_mains(self) -> List[torch.Tensor]:
        return [main.detach().clone() for main in self._mains()]

    def _publish(self, defer_gather: bool = False) -> None:
        for part in self.dense:
            publish_main_params(part, defer_gather)
