"""The optimizers by their ``--optimizer`` name, each a Megatron-Core ``MegatronOptimizer``.

``"adam"`` is Megatron's own (``get_megatron_optimizer``), ``"logra"`` LoGRA's
(:func:`~logra_megatron.logra.optimizer.get_logra_optimizer`: Megatron's optimizer for the dense
remainder chained with the sketch space). Both are
:class:`~logra_megatron.optim.controlled.ControlledOptimizer`: Megatron's ``ChainedOptimizer``
API for the training loop and checkpointing, plus ``propose`` / ``preview`` / ``commit`` /
``discard`` for the KL controller, ``reset_state``, ``set_lr``, ``state_bytes`` and
``diagnostics``. The trainer, the smoke job, the benchmarks and ``examples/megatron_loop.py``
build them here.
"""

from typing import Callable, Dict, List, Optional

from logra_megatron.logra import LogRAConfig
from logra_megatron.logra.optimizer import get_logra_optimizer
from logra_megatron.optim.controlled import STATE_BYTES_KEYS, ControlledOptimizer
from logra_megatron.optim.factory import get_dense_optimizer

__all__ = ["OPTIMIZERS", "STATE_BYTES_KEYS", "ControlledOptimizer", "TrainingOptimizer", "build_optimizer",
           "register_optimizer"]

TrainingOptimizer = ControlledOptimizer
"""What the training code programs against (the KL controller's type hints)."""

Builder = Callable[[object, List, Optional[LogRAConfig]], ControlledOptimizer]

OPTIMIZERS: Dict[str, Builder] = {}
"""``--optimizer`` name -> ``builder(megatron_optimizer_config, model_chunks, logra_config)``; the
names are those of ``training.config.OPTIMIZERS`` (which validates the flag)."""


def register_optimizer(name: str):
    """Decorator: register ``builder`` under ``name``."""

    def register(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        return builder

    return register


def build_optimizer(kind: str, megatron_optimizer_config, model_chunks: List,
                    logra_config: Optional[LogRAConfig] = None) -> ControlledOptimizer:
    """The optimizer ``kind`` names over ``model_chunks`` (Megatron DDP models)."""
    return OPTIMIZERS[kind](megatron_optimizer_config, model_chunks, logra_config)


register_optimizer("adam")(lambda config, chunks, logra_config: get_dense_optimizer(config, chunks))
register_optimizer("logra")(get_logra_optimizer)
