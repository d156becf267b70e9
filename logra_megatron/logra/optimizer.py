"""LogRAOptimizer: one Megatron-Core ``ChainedOptimizer`` over the whole model, and
:func:`get_logra_optimizer`, its factory, shaped like Megatron's ``get_megatron_optimizer``.

Its parts are Megatron's own optimizers of the dense remainder (embeddings, norms, biases: what
``get_megatron_optimizer`` builds over the parameters that still take a gradient) and, last,
:class:`~logra_megatron.logra.sketch_optimizer.SketchSpaceOptimizer` for the sketched weights.
The chain (:class:`~logra_megatron.optim.controlled.ControlledOptimizer`) takes one global
gradient norm over both (and LoGRA's estimate of the gradient outside the sketch), clips both by
it, offers Megatron's whole optimizer API to a Megatron-LM loop, and the KL controller's
propose / preview / commit.

Swapping it into a Megatron-LM loop is two lines, the layer spec and the optimizer factory::

    model = get_model(partial(model_provider, layer_spec=logra_layer_spec()))
    optimizer = get_logra_optimizer(optimizer_config, model, LogRAConfig())
"""

import math
from dataclasses import replace
from typing import Dict, List, Optional

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from logra_megatron.logra.config import LogRAConfig
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.logra.sketch_optimizer import SketchSpaceOptimizer
from logra_megatron.optim.controlled import ControlledOptimizer
from logra_megatron.optim.megatron_internals import flatten_chain


class LogRAOptimizer(ControlledOptimizer):
    """Megatron's dense optimizers (``dense``) chained with the sketch space (``sketch``)."""

    def __init__(self, model_chunks: List, dense: List, sketch: SketchSpaceOptimizer):
        super().__init__(model_chunks, dense, sketch)
        self.sketch = sketch
        self._grams: Dict[str, tuple] = {}
        """Sketched weight name -> (its projection, that tensor's version, ``Q^T Q`` or None)."""

    def diagnostics(self) -> Dict[str, float]:
        """The last step's gradient norms: ``grad_norm`` (what clipping used: dense + sketch +
        the estimate of the gradient outside the sketch) and ``grad_norm_sketch`` (dense +
        sketch only)."""
        if "grad_norm" not in self.last_norms:
            return {}
        return {"grad_norm": self.last_norms["grad_norm"],
                "grad_norm_sketch": math.sqrt(self.last_dense_sq + self.sketch.last_norms["sketch_sq"])}

    @torch.no_grad()
    def _step_squares(self) -> List[torch.Tensor]:
        """The dense remainder's parts of ``||D||^2`` and the sketched weights': ``lr U Q^T``
        (right) or ``lr P U`` (left). With an orthonormal projection that is ``lr ||U||``;
        otherwise through the projection's ``r x r`` Gram matrix (``||U Q^T||^2 = <U Q^T Q, U>``),
        never the full-size product. The Gram matrices are kept per projection (a refresh
        replaces it): computing them, in fp64, every step cost 1.05 s a step on smollm2-135m
        (CPU, one thread), 2% of the step. The weight-decay term ``lr wd W`` is left out: the
        same fraction of ``W`` every step, it does not tell one step's length from the next."""
        squares = super()._step_squares()
        proposal = self.sketch.proposal
        if proposal is None:
            return squares
        for entry in self.sketch.sketch_buffer.weights:
            update = entry.view(proposal.update).float()
            gram = self._gram(entry)
            if gram is None:
                square = torch.linalg.vector_norm(update, dtype=torch.float64) ** 2
            elif entry.sketch.side == RIGHT:
                square = ((update @ gram) * update).sum(dtype=torch.float64)
            else:
                square = ((gram @ update) * update).sum(dtype=torch.float64)
            squares.append(square * proposal.lr**2)
        return squares

    def _gram(self, entry) -> Optional[torch.Tensor]:
        """``Q^T Q`` of ``entry``'s projection (fp32), or None where it is the identity to fp32
        rounding (orthonormal: the seeded draws and the range finder's); kept until the
        projection is replaced or changed in place."""
        projection = entry.sketch.projection
        cache = self._grams
        kept = cache.get(entry.name)
        if kept is None or kept[0] is not projection or kept[1] != projection._version:
            product = projection.double().t() @ projection.double()
            identity = torch.eye(product.shape[0], dtype=product.dtype, device=product.device)
            orthonormal = bool(torch.allclose(product, identity, rtol=0.0, atol=1e-5))
            kept = cache[entry.name] = (projection, projection._version, None if orthonormal else product.float())
        return kept[2]

    # --- the sketch space, named as the trainer, the policy sync and the tests read it ----------

    @property
    def sketch_buffer(self):
        return self.sketch.sketch_buffer

    @property
    def update_rule(self):
        return self.sketch.update_rule

    @property
    def masters(self):
        return self.sketch.masters

    @property
    def norm_estimator(self):
        return self.sketch.norm_estimator

    @property
    def step_count(self) -> int:
        return self.sketch.step_count

    @property
    def proposal(self):
        """The proposed, not yet committed, sketch-space step (None when there is none)."""
        return self.sketch.proposal

    @property
    def refresh(self):
        return self.sketch.refresh

    @property
    def commit_log(self):
        return self.sketch.commit_log

    @property
    def weights(self):
        """The sketched weights' bookkeeping (:class:`~logra_megatron.logra.sketch_buffer.SketchedWeight`)."""
        return self.sketch.sketch_buffer.weights

    @property
    def refreshes_done(self) -> int:
        return self.sketch.refresh.refreshes_done

    @property
    def redraws_projections(self) -> bool:
        return self.sketch.redraws_projections

    def log_commits(self, limit: int) -> None:
        self.sketch.log_commits(limit)

    def is_refresh_step(self) -> bool:
        return self.sketch.is_refresh_step()

    def sketches(self) -> dict:
        """This rank's current sketches by global weight name (views, not copies)."""
        return self.sketch.sketch_buffer.sketches()

    def projections(self) -> dict:
        return self.sketch.sketch_buffer.projections()


def get_logra_optimizer(config: OptimizerConfig, model_chunks: List,
                        logra_config: Optional[LogRAConfig] = None) -> LogRAOptimizer:
    """LoGRA over ``model_chunks`` (Megatron DDP-wrapped models built with
    :func:`~logra_megatron.logra.layers.logra_layer_spec`), as ``get_megatron_optimizer(config,
    model_chunks)`` builds Megatron's: ``config`` is Megatron's ``OptimizerConfig`` (lr, weight
    decay, Adam betas and eps, clip_grad, use_distributed_optimizer, bf16), shared by both parts.
    With ``use_distributed_optimizer`` the sketch space is sharded over data parallel too (ZeRO-1:
    its reduction is a reduce-scatter, its state a slice)."""
    logra_config = logra_config or LogRAConfig()
    if logra_config.zero1 != config.use_distributed_optimizer:
        logra_config = replace(logra_config, zero1=config.use_distributed_optimizer)
    model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    dense = flatten_chain(get_megatron_optimizer(config, model_chunks))
    return LogRAOptimizer(model_chunks, dense, SketchSpaceOptimizer(model_chunks, config, logra_config))
