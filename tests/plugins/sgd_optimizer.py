"""An optimizer OUTSIDE the logra_megatron package, chosen by flag only
(tests/test_plugins.py puts this directory on PYTHONPATH)::

    python -m logra_megatron.train --optimizer sgd_optimizer:build_sgd

Megatron-Core's own SGD with momentum (``OptimizerConfig(optimizer="sgd")``) for the whole model,
wrapped as every optimizer the trainer drives is (optim/factory.py: ``get_dense_optimizer``), so the
KL controller, the clip and checkpointing work unchanged. It appends one JSON line per build and
per step to ``$SGD_OPTIMIZER_LOG`` so a test can see that it was the one used.
"""

import dataclasses
import json
import os

from logra_megatron.optim.factory import get_dense_optimizer

LOG_ENV = "SGD_OPTIMIZER_LOG"
MOMENTUM = 0.5


def _log(**event):
    if os.environ.get(LOG_ENV):
        with open(os.environ[LOG_ENV], "a") as log:
            log.write(json.dumps(event) + "\n")


def build_sgd(megatron_optimizer_config, model_chunks, logra_config=None):
    config = dataclasses.replace(megatron_optimizer_config, optimizer="sgd", sgd_momentum=MOMENTUM)
    optimizer = get_dense_optimizer(config, model_chunks)
    inner = [part.optimizer for part in optimizer.chained_optimizers]
    _log(event="build", inner=sorted({type(torch_optimizer).__name__ for torch_optimizer in inner}))
    commit = optimizer.commit

    def logged_commit(*args, **kwargs):
        result = commit(*args, **kwargs)
        _log(event="step")
        return result

    optimizer.commit = logged_commit
    return optimizer


def not_an_optimizer(megatron_optimizer_config, model_chunks, logra_config=None):
    """A builder that returns the wrong thing: the trainer says so in one line."""
    return object()
