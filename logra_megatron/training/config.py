"""Configs of the training layer: what both optimizers share, the learning-rate schedule, and
the predicted-KL controller. Each default is written once, here; the flags come from these
fields (logra_megatron/schema.py)."""

from dataclasses import dataclass
from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.registry import Registry
from logra_megatron.schema import option



def _is_optimizer_builder(obj) -> Optional[str]:
    """Why ``obj`` is not an optimizer builder (training/optimizer.py: ``build_optimizer``), or None."""
    if not callable(obj):
        return ("an optimizer is a function builder(megatron_optimizer_config, model_chunks, logra_config) "
                "returning a ControlledOptimizer (training/optimizer.py)")
    return None


OPTIMIZERS = Registry("optimizer", "--optimizer", accepts=_is_optimizer_builder)
"""The optimizers ``--optimizer`` selects, by name, or outside code by ``package.module:attr``: a
builder ``(megatron_optimizer_config, model_chunks, logra_config) -> ControlledOptimizer``
(training/optimizer.py builds through it). Declared by path, so reading the flag imports no torch.
``sketched=True``: the optimizer takes its gradients from LoGRA's sketches, so the model is built
with the sketching layer spec and the run's LogRAConfig applies (an outside builder says so with a
``sketches_gradients = True`` attribute)."""
OPTIMIZERS.register("adam", "logra_megatron.training.optimizer:build_dense_adam", sketched=False,
                    help="Megatron's dense Adam (the baseline)")
OPTIMIZERS.register("logra", "logra_megatron.logra.optimizer:get_logra_optimizer", sketched=True,
                    help="sketch-space Adam for the decoder's linear layers, Megatron's Adam for the rest")


def sketches_gradients(kind: str) -> bool:
    """Whether the optimizer ``kind`` names steps from LoGRA's gradient sketches (see
    :data:`OPTIMIZERS`); an outside one is imported to read its ``sketches_gradients``."""
    declared = OPTIMIZERS.declared(kind)
    if declared is not None:
        return bool(declared.info["sketched"])
    return bool(getattr(OPTIMIZERS.get(kind), "sketches_gradients", False))

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""Megatron's ``--lr-decay-style`` values, all computed by its ``OptimizerParamScheduler``."""
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""Megatron's ``--lr-wsd-decay-style`` values: the shape of WSD's final decay."""
KL_MODES = ("off", "probe", "linear")
KL_TARGET_SCHEDULES = ("constant", "linear", "cosine", "exponential")
"""Shapes of the KL budget from ``--kl-target`` to ``--kl-target-final`` (training/kl_control.py:
``scheduled_kl_target``); cosine is the reference implementation's."""
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class OptimizerSettings:
    """What both optimizers share (Megatron's ``OptimizerConfig`` fields and flag names)."""

    kind: str = option("logra", flag="--optimizer", parse=OPTIMIZERS.parse, help=OPTIMIZERS.help("the optimizer"))
    lr: float = option(3e-4, help="peak learning rate of the RL phase")
    # 0.0, not Megatron's 0.01: RL post-trains a pretrained policy, and decay would pull its weights
    # towards zero on every step whatever the reward says (and spend KL budget doing it).
    weight_decay: float = option(0.0, help="decoupled (AdamW) weight decay: each step multiplies a weight by "
                                           "1 - lr x this, on the weight matrices (Megatron's param groups: "
                                           "biases and norms are not decayed) and LoGRA's sketched weights; "
                                           "0.0 here, not Megatron's 0.01")
    adam_beta1: float = option(0.9, help="Adam's first-moment decay")
    adam_beta2: float = option(0.999, help="Adam's second-moment decay")
    adam_eps: float = option(1e-8, help="Adam's epsilon")
    clip_grad: float = option(1.0, help="clip the global gradient norm to this (0 disables)")
    distributed: bool = option(False, flag="--use-distributed-optimizer",
                               help="ZeRO-1: shard optimizer state over data parallel (Megatron's "
                                    "distributed optimizer; LoGRA reduce-scatters its sketches)")

    @property
    def sketched(self) -> bool:
        """The optimizer steps from LoGRA's sketches (:func:`sketches_gradients`)."""
        return sketches_gradients(self.kind)

    def __post_init__(self):
        OPTIMIZERS.check(self.kind)
        if self.lr < 0:
            raise UserError(f"--lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise UserError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise UserError(f"--clip-grad must be >= 0 (0 disables), got {self.clip_grad}")


@dataclass(frozen=True)
class LRScheduleConfig:
    """The RL phase's learning rate: linear warm-up from 0, then decay from ``--lr`` to
    ``--min-lr`` over ``--lr-decay-iters`` (default ``--train-iters``), Megatron's flags with
    Megatron's meanings, computed by Megatron's ``OptimizerParamScheduler``. Iterations are RL
    optimizer steps (a skipped step does not advance the schedule)."""

    min_lr: float = option(0.0, help="the lr decays from --lr to this over --lr-decay-iters")
    lr_warmup_iters: int = option(0, help="linear lr warm-up steps at the start of RL")
    lr_decay_style: str = option("cosine", choices=LR_DECAY_STYLES,
                                 help="shape of the decay (WSD: constant at --lr, then --lr-wsd-decay-style over "
                                      "the last --lr-wsd-decay-iters of --lr-decay-iters)")
    lr_decay_iters: Optional[int] = option(None, help="iterations over which the lr decays to --min-lr (default: "
                                                      "--train-iters); after them it stays at --min-lr")
    lr_wsd_decay_style: str = option("exponential", choices=LR_WSD_DECAY_STYLES,
                                     help="with --lr-decay-style WSD: shape of the final decay")
    lr_wsd_decay_iters: Optional[int] = option(None, help="with --lr-decay-style WSD: iterations of the final "
                                                          "decay, the last ones of --lr-decay-iters")

    def __post_init__(self):
        if self.min_lr < 0:
            raise UserError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.lr_warmup_iters < 0:
            raise UserError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise UserError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, "
                            f"got {self.lr_decay_style!r}")
        if self.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            raise UserError(f"--lr-wsd-decay-style must be one of {', '.join(LR_WSD_DECAY_STYLES)}, "
                            f"got {self.lr_wsd_decay_style!r}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise UserError(f"--lr-decay-iters must be >= 1, got {self.lr_decay_iters}")
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_iters is None:
                raise UserError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (the final decay's iterations)")
            if self.lr_wsd_decay_iters < 1:
                raise UserError(f"--lr-wsd-decay-iters must be >= 1, got {self.lr_wsd_decay_iters}")
        elif self.lr_wsd_decay_iters is not None:
            raise UserError(f"--lr-wsd-decay-iters needs --lr-decay-style WSD, got --lr-decay-style "
                            f"{self.lr_decay_style}")

    def decay_iters(self, train_iters: int) -> int:
        """``--lr-decay-iters``, Megatron's default ``--train-iters`` when not given."""
        return train_iters if self.lr_decay_iters is None else self.lr_decay_iters

    def check_iters(self, train_iters: int) -> None:
        """The decay window against the run: WSD's final decay fits in what is left of
        ``--lr-decay-iters`` after the warm-up (the scheduler would divide by zero or go
        negative otherwise)."""
        decay = self.decay_iters(train_iters)
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters > max(decay - self.lr_warmup_iters, 1):
            raise UserError(f"--lr-wsd-decay-iters {self.lr_wsd_decay_iters} exceeds the {decay} lr decay iters "
                            f"(--lr-decay-iters, default --train-iters) less --lr-warmup-iters {self.lr_warmup_iters}")


@dataclass(frozen=True)
class KLControlConfig:
    """Settings of the predicted-KL controller (docs/ALGORITHM.md, "KL control")."""

    mode: str = option("probe", flag="--kl-control", choices=KL_MODES,
                       help="off: plain optimizer step; probe: forward at W + D (exact forecast); "
                            "linear: first-order forecast")
    target: float = option(0.01, flag="--kl-target",
                           help="largest forecast KL per response token a step may cause (nats)")
    probe_sequences: int = option(8, flag="--kl-probe-sequences",
                                  help="sequences of the batch (spread over its prompts) that form the probe set")
    realized_interval: int = option(5, flag="--kl-realized-interval",
                                    help="every N steps measure the KL of the committed update on batch rows "
                                         "the probe did not see (0 = never)")
    max_scale: Optional[float] = option(
        None, flag="--kl-max-scale",
        help="largest step scale: above 1 a step whose forecast is below the target grows up to this factor "
             "(default: the update rule's: 1, or 3 with --logra-update rowadam, as the reference implementation)")
    subtract_mismatch: bool = option(
        False, flag="--kl-subtract-mismatch",
        help="lower the KL target by an EMA of the rollout engine's observed mismatch (the KL from "
             "the engine's sampling distribution to the trainer's, estimated on the sampled tokens), "
             "floored at half the target, as the reference implementation does; needs an engine that "
             "returns log-probs")
    target_final: Optional[float] = option(
        None, flag="--kl-target-final",
        help="the KL budget at the end of --kl-target-schedule (--kl-target is where it starts); the reference "
             "implementation decays 2e-4 -> 2e-5 on a cosine")
    target_schedule: str = option(
        "constant", flag="--kl-target-schedule", choices=KL_TARGET_SCHEDULES,
        help="shape of the KL budget over RL iterations, from --kl-target at the first to --kl-target-final at "
             "the last of --kl-target-decay-iters, then held: constant (no schedule), linear, cosine (the "
             "reference implementation's: half a cosine period), exponential (geometric); every optimizer step "
             "of an iteration gets its iteration's budget")
    target_decay_iters: Optional[int] = option(
        None, flag="--kl-target-decay-iters",
        help="RL iterations over which the budget moves from --kl-target to --kl-target-final (default: "
             "--train-iters; the reference implementation's schedule spans 300)")
    mismatch_ema_weight: float = 0.3
    """Weight of the newest observation in the mismatch's EMA (the reference implementation's)."""
    linear_epsilon: float = 1e-3
    """Finite-difference step (a fraction of D) of the linear forecast."""
    max_refinements: int = 4
    """probe mode: extra forecasts at the scaled step while it still exceeds the target."""
    tolerance: float = 1.1
    """probe mode: a scaled step is accepted when its forecast is <= tolerance * target."""

    def __post_init__(self):
        if self.mode not in KL_MODES:
            raise UserError(f"--kl-control must be one of {', '.join(KL_MODES)}, got {self.mode!r}")
        if not self.target > 0:
            raise UserError(f"--kl-target must be > 0, got {self.target}")
        if self.probe_sequences < 1:
            raise UserError(f"--kl-probe-sequences must be >= 1, got {self.probe_sequences}")
        if self.max_scale is not None and not self.max_scale >= 1.0:
            raise UserError(f"--kl-max-scale must be >= 1, got {self.max_scale}")
        if self.realized_interval < 0:
            raise UserError(f"--kl-realized-interval must be >= 0, got {self.realized_interval}")
        if not 0 < self.linear_epsilon <= 1:
            raise UserError(f"linear_epsilon must be in (0, 1], got {self.linear_epsilon}")
        if self.max_refinements < 0 or self.tolerance < 1:
            raise UserError("max_refinements must be >= 0 and tolerance >= 1")
        if self.target_schedule not in KL_TARGET_SCHEDULES:
            raise UserError(f"--kl-target-schedule must be one of {', '.join(KL_TARGET_SCHEDULES)}, "
                            f"got {self.target_schedule!r}")
        if self.target_final is not None and not self.target_final > 0:
            raise UserError(f"--kl-target-final must be > 0, got {self.target_final}")
        if self.target_decay_iters is not None and self.target_decay_iters < 1:
            raise UserError(f"--kl-target-decay-iters must be >= 1, got {self.target_decay_iters}")
        if self.target_schedule == "constant":
            if self.target_final is not None or self.target_decay_iters is not None:
                raise UserError("--kl-target-final and --kl-target-decay-iters need a --kl-target-schedule: linear, "
                                "cosine (the reference implementation's) or exponential")
        elif self.target_final is None:
            raise UserError(f"--kl-target-schedule {self.target_schedule} needs --kl-target-final (where the "
                            "budget ends; --kl-target is where it starts)")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation, Megatron's flags with Megatron's meanings: ``selective`` keeps
    every layer's activations except core attention's (the ``b x heads x s x s`` scores and
    their softmax), recomputed in the backward; ``full`` keeps only the input of each group of
    ``--recompute-num-layers`` layers (``uniform``) or of the first ``--recompute-num-layers``
    layers of every pipeline stage (``block``) and reruns their forward in the backward. The
    numbers the backward sees are the same as without recomputation; only memory and time
    change (and no checkpoint does)."""

    granularity: Optional[str] = option(
        None, flag="--recompute-granularity", choices=RECOMPUTE_GRANULARITIES,
        help="recompute activations in the backward: selective (core attention) or full "
             "(whole layers, see --recompute-method); default: keep all activations")
    method: Optional[str] = option(
        None, flag="--recompute-method", choices=RECOMPUTE_METHODS,
        help="with --recompute-granularity full: uniform (every group of --recompute-num-layers "
             "layers keeps only its input) or block (the first --recompute-num-layers layers of "
             "each pipeline stage are recomputed, the rest keep their activations)")
    num_layers: Optional[int] = option(
        None, flag="--recompute-num-layers",
        help="with --recompute-granularity full: layers per recomputed group (uniform) or "
             "recomputed layers per pipeline stage (block)")

    def __post_init__(self):
        # Megatron's rules (TransformerConfig.__post_init__, and its training arguments for
        # selective), checked here so a bad combination is one line before anything is built.
        if self.granularity is not None and self.granularity not in RECOMPUTE_GRANULARITIES:
            raise UserError(f"--recompute-granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, "
                            f"got {self.granularity!r}")
        if self.method is not None and self.method not in RECOMPUTE_METHODS:
            raise UserError(f"--recompute-method must be one of {', '.join(RECOMPUTE_METHODS)}, got {self.method!r}")
        if self.granularity is None:
            if self.method is not None or self.num_layers is not None:
                raise UserError("--recompute-method and --recompute-num-layers need --recompute-granularity full")
        elif self.granularity == "selective":
            if self.method is not None or self.num_layers is not None:
                raise UserError("--recompute-granularity selective recomputes core attention in every layer: "
                                "it takes no --recompute-method or --recompute-num-layers")
        else:
            if self.method is None or self.num_layers is None:
                raise UserError("--recompute-granularity full needs --recompute-method {uniform,block} "
                                "and --recompute-num-layers N")
            if self.num_layers < 1:
                raise UserError(f"--recompute-num-layers must be >= 1, got {self.num_layers}")

    def check_layers(self, layers_per_stage: int) -> None:
        """``--recompute-num-layers`` against the layers one pipeline stage holds: at most that
        many, and a divisor of it for ``uniform`` (Megatron would index past the stage's last
        layer)."""
        if self.granularity != "full":
            return
        if self.num_layers > layers_per_stage:
            raise UserError(f"--recompute-num-layers {self.num_layers} exceeds the {layers_per_stage} layers "
                            f"of a pipeline stage")
        if self.method == "uniform" and layers_per_stage % self.num_layers:
            raise UserError(f"--recompute-method uniform: --recompute-num-layers {self.num_layers} must divide "
                            f"the {layers_per_stage} layers of a pipeline stage")

    def transformer_kwargs(self) -> dict:
        """The fields of Megatron's ``TransformerConfig`` these settings set."""
        return {"recompute_granularity": self.granularity, "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}
