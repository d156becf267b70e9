"""The optimizers by their ``--optimizer`` name (the registry: training/config.py ``OPTIMIZERS``),
each a Megatron-Core ``MegatronOptimizer``.

``"adam"`` is Megatron's own (``get_megatron_optimizer``), ``"logra"`` LoGRA's
(:func:`~logra_megatron.logra.optimizer.get_logra_optimizer`: Megatron's optimizer for the dense
remainder chained with the sketch space). Both are
:class:`~logra_megatron.optim.controlled.ControlledOptimizer`: Megatron's ``ChainedOptimizer``
API for the training loop and checkpointing, plus ``propose`` / ``preview`` / ``commit`` /
``discard`` for the KL controller, ``reset_state``, ``set_lr``, ``state_bytes`` and
``diagnostics``. The trainer, the smoke job, the benchmarks and ``examples/megatron_loop.py``
build them here.
"""

from typing import List, Optional

from logra_megatron.errors import UserError
from logra_megatron.logra import LogRAConfig
from logra_megatron.optim.controlled import STATE_BYTES_KEYS, ControlledOptimizer
from logra_megatron.optim.factory import get_dense_optimizer
from logra_megatron.training.config import OPTIMIZERS

__all__ = ["STATE_BYTES_KEYS", "ControlledOptimizer", "TrainingOptimizer", "build_dense_adam", "build_optimizer"]

TrainingOptimizer = ControlledOptimizer
"""What the training code programs against (the KL controller's type hints)."""


def build_dense_adam(megatron_optimizer_config, model_chunks: List,
                     logra_config: Optional[LogRAConfig] = None) -> ControlledOptimizer:
    """``--optimizer adam``: Megatron's optimizer for the whole model (``logra_config`` unused)."""
    return get_dense_optimizer(megatron_optimizer_config, model_chunks)


def build_optimizer(kind: str, megatron_optimizer_config, model_chunks: List,
                    logra_config: Optional[LogRAConfig] = None) -> ControlledOptimizer:
    """The optimizer ``kind`` names (training/config.py: ``OPTIMIZERS``, a registered name or an
    outside ``package.module:attr`` builder) over ``model_chunks`` (Megatron DDP models)."""
    optimizer = OPTIMIZERS.get(kind)(megatron_optimizer_config, model_chunks, logra_config)
    if not isinstance(optimizer, ControlledOptimizer):
        raise UserError(f"--optimizer {kind}: the builder returned {type(optimizer).__name__}, not a "
                        "ControlledOptimizer (wrap a Megatron optimizer with optim/factory.py: get_dense_optimizer "
                        "or ControlledOptimizer)")
    return optimizer
