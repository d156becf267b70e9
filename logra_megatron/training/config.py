"""Configs of the training layer: the optimizer both kinds share, and the predicted-KL
controller."""

from dataclasses import dataclass

from logra_megatron.errors import UserError

OPTIMIZERS = ("adam", "logra")


@dataclass
class OptimizerSettings:
    """What both optimizers share."""

    kind: str = "logra"
    """"adam" (Megatron dense Adam, the baseline) or "logra"."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    distributed: bool = False
    """ZeRO-1: Megatron's distributed optimizer for dense params, sliced sketch state."""

    def __post_init__(self):
        if self.kind not in OPTIMIZERS:
            raise UserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.kind!r}")
        if self.lr < 0:
            raise UserError(f"--lr must be >= 0, got {self.lr}")


KL_MODES = ("off", "probe", "linear")


@dataclass(frozen=True)
class KLControlConfig:
    """Settings of the predicted-KL controller (flags ``--kl-*``)."""

    mode: str = "probe"
    """"off" (plain optimizer step), "probe" (forward at W + D) or "linear" (first-order)."""
    target: float = 0.01
    """kl_target: the largest forecast KL per response token a step may cause (nats)."""
    probe_sequences: int = 2
    """How many sequences of the current batch form the probe set."""
    realized_interval: int = 1
    """Measure the realized KL of the committed update every N steps (0 = never)."""
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
        if self.realized_interval < 0:
            raise UserError(f"--kl-realized-interval must be >= 0, got {self.realized_interval}")
        if not 0 < self.linear_epsilon <= 1:
            raise UserError(f"linear_epsilon must be in (0, 1], got {self.linear_epsilon}")
        if self.max_refinements < 0 or self.tolerance < 1:
            raise UserError("max_refinements must be >= 0 and tolerance >= 1")
