"""Predicted-KL step control: forecast how far an update moves the policy, shrink it if too far.

Around any training optimizer (LoGRA or dense Adam; training/optimizer.py), one controlled step is:

1. ``p_old``: vocab-parallel logits of the probe set (the response tokens of a few sequences of
   the current batch) through the pipeline schedule, forward only.
2. The optimizer computes and applies its proposed update ``D`` (moments advance once; they do
   not depend on the step size). The weights before (``W``) and after (``W + D``) are kept.
3. Forecast ``KL_pred = E_tokens KL(p_old || p_{W+D})``:
   - ``probe``: one forward at ``W + D`` (the exact KL of the proposed update on the probe);
   - ``linear``: a first-order forecast that never evaluates ``W + D``: the logit change along
     ``D`` by a forward finite difference at ``W + eps D`` (``delta = (z(W + eps D) - z(W)) / eps``)
     and ``KL ~ 0.5 Var_p(delta)`` per token, the second-order expansion of the KL. An
     approximation: accurate for small steps, an under-estimate when the step leaves the
     quadratic regime.
   Full-vocabulary sums run on vocab-parallel logits with all-reduces over TP; the vocabulary
   is never gathered. The scalar is computed on the last pipeline stage, broadcast over the
   pipeline and averaged over data-parallel replicas, so every rank agrees.
4. ``s = min(1, sqrt(kl_target / KL_pred))`` (KL is quadratic in the step near zero). Far from
   zero the KL of a large step grows slower than quadratically (measured on ``tiny``: KL(D) was
   0.10 where the quadratic extrapolation of small steps gave 0.72), so ``sqrt`` scaling alone
   under-shrinks a step that overshoots by a lot. ``probe`` mode therefore re-forecasts at
   ``s D`` and rescales ``s <- s sqrt(kl_target / KL(s D))`` while the forecast exceeds the
   target by more than ``tolerance`` (at most ``max_refinements`` extra probes). The weights are
   restored bitwise to ``W`` and ``W + s D`` is committed. The optimizer's master copies are
   re-synced from the model (``reload_model_params``) so mixed-precision runs stay consistent.
5. Every ``realized_interval`` steps the realized KL of the committed update is measured on the
   same probe, so the forecast's calibration is visible.

Cost: two copies of this rank's weights live during the step (``W`` and ``W + D``) and one or
two forward passes over the probe set.
"""

import math
import time
from typing import List, Optional

import torch

from logra_megatron import parallel
from logra_megatron.ops.vocab_parallel import vocab_parallel_mean_half_variance, vocab_parallel_mean_kl
from logra_megatron.training.config import KLControlConfig
from logra_megatron.training.lm import forward_logits
from logra_megatron.training.optimizer import TrainingOptimizer

class PredictedKLController:
    """Wraps ``optimizer.step()`` with the forecast-and-scale procedure described above."""

    def __init__(self, config: KLControlConfig):
        self.config = config
        self.steps = 0
        # Optional ``logits_fn(model) -> vocab-parallel logits`` for probes that need their own
        # masks and positions (left-padded rollouts); default: a plain causal forward.
        self.logits_fn = None

    # --- building blocks (public for tests and the demo) -----------------------------------------

    @staticmethod
    def parameters_of(model) -> List[torch.nn.Parameter]:
        return [param for param in model.parameters()]

    @staticmethod
    @torch.no_grad()
    def set_weights(params, base, direction=None, scale: float = 1.0) -> None:
        """``param <- base`` (bitwise) or ``param <- base + scale * direction``."""
        for param, start, *rest in zip(params, base, *([direction] if direction is not None else [])):
            if direction is None:
                param.copy_(start)
            else:
                param.copy_(start + scale * rest[0])

    def probe_logits(self, model, probe_tokens: torch.Tensor, micro_batch_size: Optional[int] = None):
        if self.logits_fn is not None:
            return self.logits_fn(model)
        return forward_logits(model, probe_tokens, micro_batch_size)

    def kl_between(self, old_logits, model, probe_tokens, probe_mask) -> float:
        """Agreed mean KL(p_old || p_current) over the probe's masked tokens."""
        value = 0.0
        new_logits = self.probe_logits(model, probe_tokens)
        if parallel.is_last_stage():
            value = vocab_parallel_mean_kl(old_logits, new_logits, probe_mask)
        return parallel.agree_on_scalar(value)

    def forecast(self, model, old_logits, params, before, direction, probe_tokens, probe_mask,
                 scale: float = 1.0) -> float:
        """KL_pred of the update ``scale * direction`` from ``before``; leaves the weights at
        ``before`` (bitwise)."""
        if self.config.mode == "linear":
            epsilon = self.config.linear_epsilon
            self.set_weights(params, before, direction, epsilon * scale)
            logits = self.probe_logits(model, probe_tokens)
            value = 0.0
            if parallel.is_last_stage():
                delta = (logits.double() - old_logits.double()) / epsilon
                value = vocab_parallel_mean_half_variance(old_logits, delta, probe_mask)
            self.set_weights(params, before)
            return parallel.agree_on_scalar(value)
        self.set_weights(params, before, direction, scale)
        value = self.kl_between(old_logits, model, probe_tokens, probe_mask)
        self.set_weights(params, before)
        return value

    def _refine(self, model, old_logits, params, before, direction, probe_tokens, probe_mask,
                scale: float, kl_full: float) -> float:
        """Re-forecast at the scaled step until it is within tolerance of the target. The local
        growth exponent of KL in the step size (2 near zero, towards 1 for large steps) is
        estimated from the last two forecasts, in log space, and used for the next scale."""
        config = self.config
        previous_scale, previous_kl = 1.0, kl_full
        for _ in range(config.max_refinements):
            kl = self.forecast(model, old_logits, params, before, direction, probe_tokens, probe_mask, scale)
            if kl <= config.tolerance * config.target:
                return scale
            exponent = 2.0
            if kl > 0 and previous_kl > kl and previous_scale > scale:
                exponent = math.log(previous_kl / kl) / math.log(previous_scale / scale)
                exponent = min(2.0, max(1.0, exponent))
            previous_scale, previous_kl = scale, kl
            scale *= (config.target / kl) ** (1.0 / exponent)
        return scale

    # --- the controlled step --------------------------------------------------------------------

    @torch.no_grad()
    def step(self, model, optimizer: TrainingOptimizer, probe_tokens: torch.Tensor, probe_mask: torch.Tensor,
             logits_fn=None) -> dict:
        """One optimizer step under control. ``model`` is the (DDP) model the optimizer trains;
        ``probe_tokens`` ``[n, s]`` and ``probe_mask`` ``[n, s]`` (1 on response tokens whose
        next-token distribution is compared) come from this rank's batch.

        Returns ``success, grad_norm, kl_pred, step_scale, kl_realized, controller_time_s``.
        """
        config = self.config
        self.logits_fn = logits_fn
        measure_realized = config.realized_interval > 0 and self.steps % config.realized_interval == 0
        self.steps += 1
        if config.mode == "off" and not measure_realized:
            success, grad_norm, _ = optimizer.step()
            return {"success": success, "grad_norm": grad_norm, "kl_pred": None, "step_scale": 1.0,
                    "kl_realized": None, "controller_time_s": 0.0}

        start = time.perf_counter()
        old_logits = self.probe_logits(model, probe_tokens)
        params = self.parameters_of(model)
        before = [param.detach().clone() for param in params]
        overhead = time.perf_counter() - start
        success, grad_norm, _ = optimizer.step()
        start = time.perf_counter()
        kl_pred, scale = None, 1.0
        if config.mode != "off":
            direction = [param.detach() - base for param, base in zip(params, before)]
            kl_pred = self.forecast(model, old_logits, params, before, direction, probe_tokens, probe_mask)
            scale = 1.0 if kl_pred <= config.target else math.sqrt(config.target / kl_pred)
            if config.mode == "probe" and scale < 1.0:
                scale = self._refine(model, old_logits, params, before, direction, probe_tokens,
                                     probe_mask, scale, kl_pred)
            self.set_weights(params, before, direction, scale)
            optimizer.reload_model_params()
        kl_realized = None
        if measure_realized:
            kl_realized = self.kl_between(old_logits, model, probe_tokens, probe_mask)
        overhead += time.perf_counter() - start
        return {"success": success, "grad_norm": grad_norm, "kl_pred": kl_pred, "step_scale": scale,
                "kl_realized": kl_realized, "controller_time_s": overhead}
