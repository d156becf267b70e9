"""Learning-rate schedules through Megatron's ``OptimizerParamScheduler``, for both phases of a
run (the supervised warm-up and RL), over any optimizer that exposes ``param_groups``."""

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_scheduler(optimizer, max_lr: float, min_lr: float, decay_steps: int, decay_style: str,
                    warmup_steps: int = 0, weight_decay: float = 0.0, wsd_decay_steps: int = None,
                    wsd_decay_style: str = None) -> OptimizerParamScheduler:
    """A scheduler that sets every param group's lr: linear warm-up from 0 over ``warmup_steps``,
    then ``decay_style`` ("constant", "linear", "cosine", "inverse-square-root", "WSD") from
    ``max_lr`` to ``min_lr``, reaching ``min_lr`` at step ``decay_steps`` (WSD: constant until
    the last ``wsd_decay_steps`` of them, then ``wsd_decay_style``). Weight decay stays constant. The lr of step 0 is set on
    construction; call ``step(1)`` after each optimizer step."""
    for group in optimizer.param_groups:  # Megatron's groups carry None for these by default
        group["max_lr"], group["min_lr"] = max_lr, min_lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else max_lr, max_lr=max_lr, min_lr=min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=max(decay_steps, 1), wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=wsd_decay_style)
