"""The optimizer protocol the training code programs against, and the registry of optimizers by
their ``--optimizer`` name.

Both optimizers satisfy :class:`TrainingOptimizer`: ``"adam"``, Megatron's dense Adam behind
:class:`~logra_megatron.training.dense_optimizer.DenseOptimizer`, and ``"logra"``,
:class:`~logra_megatron.logra.optimizer.LogRAOptimizer` (sketch-space update for the sketched
weights, a ``DenseOptimizer`` for the remainder, injected here). The trainer, the KL
controller, checkpointing and the benchmark use nothing else of them.
"""

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

from megatron.core.optimizer import get_megatron_optimizer

from logra_megatron.logra import LogRAConfig, LogRAOptimizer
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.dense_optimizer import DenseOptimizer

STATE_BYTES_KEYS = ("grad_bytes", "optimizer_state_bytes", "master_weight_bytes", "projection_bytes")


@runtime_checkable
class TrainingOptimizer(Protocol):
    """What a training optimizer offers (Megatron's optimizer interface, narrowed and named).

    - ``step()``: one update from the gradients the backward left (DDP grad buffers, LoGRA
      sketches), clipped by the global gradient norm. Returns ``(ok, grad_norm, num_zeros)``:
      ``ok`` False when the step was skipped (inf/NaN gradients); ``grad_norm`` the global norm
      before clipping (None when skipped); ``num_zeros`` as Megatron counts it, or None.
    - ``zero_grad(set_to_none=True)``: clear the optimizer's gradients (and LoGRA's sketches;
      on a LoGRA refresh step, arm the range finder). DDP's grad buffers are cleared separately
      with ``ddp_model.zero_grad_buffer()``.
    - ``reset_state()``: drop the moments and step counts, keep the weights (a new training
      phase starts from a clean optimizer).
    - ``param_groups``: list of dicts with ``lr`` and ``weight_decay`` (and Megatron's
      ``lr_mult``/``wd_mult``, ...), what Megatron's ``OptimizerParamScheduler`` drives.
    - ``set_lr(lr)``: set every group's ``lr``.
    - ``state_bytes()``: bytes this rank actually holds, by component (:data:`STATE_BYTES_KEYS`:
      gradients, optimizer state, fp32 master weights, LoGRA projections).
    - ``sharded_state_dict(model_sharded_state_dict, is_loading=False)``: the optimizer's state
      for ``dist_checkpointing``; ``load_state_dict(state)`` restores from what
      ``dist_checkpointing.load`` returned for it.
    - ``reload_model_params()``: re-sync master copies from the model's weights after they were
      loaded from a checkpoint without optimizer state.
    - A step in three parts, for the KL controller (``step()`` is ``propose()`` then
      ``commit(1.0)``): ``propose()`` computes the update ``D`` (returns like ``step``) and
      commits nothing that cannot be undone; ``preview(scale)`` makes forward passes see
      ``W + scale * D`` (``scale = 0``: ``W``) without losing precision of any master copy;
      ``commit(scale)`` applies ``scale * D``; ``discard()`` drops it, changing no weight.
      ``extra_bytes()`` is what a proposed step holds
      beyond the optimizer's state (copies kept to preview and undo).
    - ``diagnostics()``: extra scalars of the last step (e.g. LoGRA's two gradient norms).
    """

    @property
    def param_groups(self) -> List[dict]: ...

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def reset_state(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def state_bytes(self) -> Dict[str, int]: ...

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict: ...

    def load_state_dict(self, state) -> None: ...

    def reload_model_params(self) -> None: ...

    def propose(self) -> Tuple[bool, Optional[float], Optional[int]]: ...

    def preview(self, scale: float) -> None: ...

    def commit(self, scale: float) -> None: ...

    def discard(self) -> None: ...

    def extra_bytes(self) -> int: ...

    def diagnostics(self) -> Dict[str, float]: ...


Builder = Callable[[OptimizerSettings, object, object, Optional[LogRAConfig]], TrainingOptimizer]

OPTIMIZERS: Dict[str, Builder] = {}
"""``--optimizer`` name -> ``builder(settings, ddp_model, megatron_optimizer_config, logra_config)``;
the names are those of ``training.config.OPTIMIZERS`` (which validates the flag)."""


def register_optimizer(name: str):
    """Decorator: register ``builder`` under ``name``."""

    def register(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        return builder

    return register


def build_optimizer(settings: OptimizerSettings, ddp_model, megatron_optimizer_config,
                    logra_config: Optional[LogRAConfig] = None) -> TrainingOptimizer:
    """The optimizer ``settings.kind`` names, over ``ddp_model`` (Megatron DDP, one chunk).
    ``megatron_optimizer_config`` is Megatron's ``OptimizerConfig``; ``logra_config`` is used
    by LoGRA only (default :class:`LogRAConfig`)."""
    return OPTIMIZERS[settings.kind](settings, ddp_model, megatron_optimizer_config, logra_config)


@register_optimizer("adam")
def _build_adam(settings, ddp_model, megatron_optimizer_config, logra_config) -> DenseOptimizer:
    return DenseOptimizer(get_megatron_optimizer(megatron_optimizer_config, [ddp_model]), ddp_model)


@register_optimizer("logra")
def _build_logra(settings, ddp_model, megatron_optimizer_config, logra_config) -> LogRAOptimizer:
    logra_config = logra_config or LogRAConfig()
    if logra_config.zero1 != settings.distributed:
        logra_config = replace(logra_config, zero1=settings.distributed)
    dense = DenseOptimizer(get_megatron_optimizer(megatron_optimizer_config, [ddp_model]), ddp_model)
    return LogRAOptimizer([ddp_model], megatron_optimizer_config, logra_config, dense)
