"""LoGRA settings: one documented dataclass, validated on construction."""

import json
from dataclasses import dataclass
from typing import Union

from logra_megatron.errors import UserError
from logra_megatron.registry import Registry
from logra_megatron.schema import json_object_text, option

# The default rank: half of each weight's projected dimension, at most 256. Chosen with the memory
# planner (docs/OPTIMIZER.md, "The default rank"): the fraction alone gives r = 2560 on qwen2.5-32b, where
# LoGRA then fits no layout of 8 x 80 GB; capped at 256 it fits there, and alone on one 141 GB GPU
# (bf16-sr); at 512 mistral-small-24b no longer fits one 80 GB GPU. The models whose learning was
# measured keep (tiny: 32) or nearly keep (smollm2-135m: 288 -> 256) their fractional ranks. The
# trainer, the planner, the smoke job and the benchmarks all take these two constants.
DEFAULT_RANK = 0.5
"""``--logra-rank``'s default (a fraction of the projected dimension)."""
DEFAULT_MAX_RANK = 256
"""``--logra-max-rank``'s default: the cap on a fractional rank."""
MOMENT_POLICIES = ("rotate", "reset")
MASTER_MODES = ("fp32", "bf16-sr", "none")


def _is_update_rule(obj) -> "str | None":
    """Why ``obj`` is not an update rule (logra/update_rules.py: ``UpdateRule``), or None."""
    if not isinstance(obj, type):
        return "an update rule is a class, constructed as Rule(buffer, optimizer_config, logra_config)"
    missing = [name for name in ("state_names", "state_layout", "projections", "update", "state", "reset",
                                 "counters", "load_counters") if not hasattr(obj, name)]
    return f"the class lacks {', '.join(missing)} (logra/update_rules.py: UpdateRule)" if missing else None


UPDATE_RULES = Registry("update rule", "--logra-update", accepts=_is_update_rule)
"""The sketch-space update rules ``--logra-update`` selects, by name, or outside code by
``package.module:attr`` (a class implementing logra/update_rules.py's ``UpdateRule``). Declared by
path, so reading the flag imports no torch; a new rule in the package is one file and one line
here."""
# ``memory=``: the rule's memory, declared without torch (logra/update_memory.py), so the planner
# counts it without importing the rule's module.
UPDATE_RULES.register(
    "adam", "logra_megatron.logra.update_adamw:SketchAdamW",
    memory="logra_megatron.logra.update_memory:SketchAdamWMemory",
    help="Adam moments per sketch element, orthonormal projections refreshed by a range finder")
UPDATE_RULES.register(
    "rowadam", "logra_megatron.logra.update_rowadam:RowAdam",
    memory="logra_megatron.logra.update_memory:RowAdamMemory",
    help="the reference implementation's rule: a fresh Rademacher projection every step, so "
         "--logra-refresh-interval, --logra-oversampling and --logra-norm-probes do not apply; one second "
         "moment per row, each step's update sized --logra-rowadam-step x ||W||; --kl-max-scale defaults to 3; "
         "no --use-distributed-optimizer (its state is per line)")
UPDATE_RULE_NAMES = UPDATE_RULES.names()
"""The registered rules' names (outside rules come by path)."""


@dataclass(frozen=True)
class LogRAConfig:
    """How weight gradients are sketched and how the sketch-space Adam behaves."""

    update: str = option(
        "adam", flag="--logra-update", parse=UPDATE_RULES.parse, help=UPDATE_RULES.help("the sketch-space update rule"))
    update_options: str = option(
        "", flag="--logra-update-options", parse=json_object_text,
        help="the update rule's own options as a JSON object, for a rule that declares an options dataclass "
             "(an outside rule's 'options' attribute), e.g. '{\"scale\": 0.5}'")
    rowadam_step: float = option(
        6e-5, flag="--logra-rowadam-step",
        help="rowadam: the update of all sketched weights together has norm this x their norm at the peak "
             "--lr (the reference's 6e-5), scaled by the lr schedule (lr / --lr) and then by the KL controller")
    rank: Union[int, float] = option(
        DEFAULT_RANK, flag="--logra-rank", parse=lambda text: parse_rank(text),
        help="sketch rank r per weight: an integer, or a fraction in (0, 1] of the projected "
             "dimension (the in-features of a column-parallel weight, the out-features of a row-parallel one), "
             "at most --logra-max-rank")
    max_rank: int = option(
        DEFAULT_MAX_RANK, flag="--logra-max-rank",
        help="the largest rank a fractional --logra-rank gives a weight (0: no cap); an integer "
             "--logra-rank is used as given. The default keeps a 32B model's sketches, moments and "
             "projections within one GPU's memory (docs/OPTIMIZER.md)")
    refresh_interval: int = option(
        10, flag="--logra-refresh-interval",
        help="refresh every projection every K optimizer steps with a randomized range finder computed "
             "in that step's backward (step 0 always runs it); not used by --logra-update rowadam, which "
             "draws a new projection for every step")
    oversampling: int = option(4, flag="--logra-oversampling",
                               help="extra columns p of the range finder's Gaussian test matrix (r + p in all)")
    second_moment: str = option(
        "rotate", flag="--logra-second-moment", choices=MOMENT_POLICIES,
        help="second moment across a refresh: rotate (carried into the new basis with squared "
             "coefficients) or reset (restarted with its bias correction)")
    """"rotate" is the default: with "reset" the rotated first moment is divided by a one-sample
    second moment and the step blows up (tests/test_logra_training.py measures both on the same
    task)."""
    master: str = option(
        "fp32", flag="--logra-master", choices=MASTER_MODES,
        help="with --bf16, where a sketched weight's update accumulates: fp32 (an fp32 master copy, "
             "4 bytes/param, sharded over DP with --use-distributed-optimizer), bf16-sr (no master: "
             "stochastic rounding into the bf16 weight), none (no master, round to nearest: lossy)")
    norm_probes: int = option(
        8, flag="--logra-norm-probes",
        help="Gaussian probes per sketched weight that estimate the gradient outside the sketch, so "
             "clipping and the logged grad_norm use an estimate of the full gradient norm; 0 clips on "
             "the sketch norm alone (not used by --logra-update rowadam: the norm of its Rademacher sketch is "
             "itself an unbiased estimate of the gradient's)")
    embeddings: bool = option(
        False, flag="--logra-embeddings",
        help="also sketch the word embedding and the output layer (tied or not; vocabulary-parallel), "
             "which otherwise stay dense with Megatron's Adam")
    zero1: bool = False
    """Distributed (ZeRO-1 style) mode: reduce-scatter the sketches over data parallel, keep one
    slice of the sketch-space Adam state per DP rank, all-gather the low-rank update. The dense
    remainder then uses Megatron's distributed optimizer."""
    identity_projection: bool = False
    """Use the identity as the (full-rank) projection and never refresh: sketch-space Adam is
    then exactly dense Adam. For tests of the optimizer's plumbing."""
    seed: int = 1234
    """Seeds the initial projections and the range finder's test matrices (per weight name),
    so every rank that shares a projection builds the same one. The trainer sets it from
    ``--seed``."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, float)):
            raise UserError(f"--logra-rank must be an integer or a fraction, got {self.rank!r}")
        if isinstance(self.rank, int) and self.rank < 1:
            raise UserError(f"--logra-rank must be >= 1, got {self.rank}")
        if isinstance(self.rank, float) and not 0.0 < self.rank <= 1.0:
            raise UserError(f"--logra-rank as a fraction must be in (0, 1], got {self.rank}")
        if isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int) or self.max_rank < 0:
            raise UserError(f"--logra-max-rank must be an integer >= 0 (0: no cap), got {self.max_rank!r}")
        if self.refresh_interval < 1:
            raise UserError(f"--logra-refresh-interval must be a positive number of steps, got {self.refresh_interval}")
        if self.oversampling < 0:
            raise UserError(f"--logra-oversampling must be >= 0, got {self.oversampling}")
        if self.master not in MASTER_MODES:
            raise UserError(f"--logra-master must be one of {', '.join(MASTER_MODES)}, got {self.master!r}")
        if self.norm_probes < 0:
            raise UserError(f"--logra-norm-probes must be >= 0, got {self.norm_probes}")
        UPDATE_RULES.check(self.update)
        if self.update_options or UPDATE_RULES.is_path(self.update):  # a registered rule is not imported here
            self.rule_options()
        if not self.rowadam_step > 0:
            raise UserError(f"--logra-rowadam-step must be > 0, got {self.rowadam_step}")
        if self.zero1 or self.identity_projection:
            self._check_rule_declarations()
        if self.second_moment not in MOMENT_POLICIES:
            raise UserError(f"--logra-second-moment must be one of {', '.join(MOMENT_POLICIES)}, got {self.second_moment!r}")

    def _check_rule_declarations(self) -> None:
        """Refuse the layouts the update rule's own declarations exclude (logra/update_memory.py),
        whatever its name: state kept per line cannot be cut into ZeRO-1 slices, and a rule that
        redraws its projections every step has no fixed (identity) one."""
        # Imported here: update_memory imports this module's registry.
        from logra_megatron.logra.update_memory import LINE, REDRAW, declared_memory
        memory = declared_memory(self.update)
        if self.zero1 and memory.state_layout == LINE:
            raise UserError(f"--logra-update {self.update} keeps its state ({', '.join(memory.state_names)}) per "
                            "line of each weight, which a ZeRO-1 slice of the sketch buffer cuts through: drop "
                            "--use-distributed-optimizer")
        if self.identity_projection and memory.projections == REDRAW:
            raise UserError(f"--logra-update {self.update} draws a random projection every step: it cannot use "
                            "the identity projection")

    def rule_options(self):
        """The update rule's options dataclass built from ``--logra-update-options`` (None when the
        rule declares none); a rule that declares one is constructed with it as a fourth argument."""
        return UPDATE_RULES.options_for(self.update, json.loads(self.update_options or "{}"),
                                        "--logra-update-options")

    def rank_for(self, projected_dim: int, weight_name: str) -> int:
        """The rank used for a weight whose projected side has ``projected_dim`` rows: an
        integer rank as given, a fraction of ``projected_dim`` capped at ``max_rank``."""
        if isinstance(self.rank, float):
            rank = max(1, round(self.rank * projected_dim))
            return min(rank, self.max_rank) if self.max_rank else rank
        if self.rank > projected_dim:
            raise UserError(
                f"--logra-rank {self.rank} is larger than the matrix: {weight_name} projects a "
                f"dimension of {projected_dim}; use a rank <= {projected_dim} or a fraction"
            )
        return self.rank

    def sketch_rank(self, projected_dim: int, weight_name: str) -> int:
        """The rank a weight is sketched at, as the planner and the accounting count it: the whole
        projected dimension under the identity projection (which the sketch buffer requires of
        ``rank``), else :meth:`rank_for`."""
        return projected_dim if self.identity_projection else self.rank_for(projected_dim, weight_name)

    def check_model(self, model) -> None:
        """Raise a :class:`UserError` now if the rank does not fit the model (a ModelConfig).

        Every sketched weight projects a dimension of ``hidden``: the input of linear_qkv and
        linear_fc1 (right sketches) and the output of linear_proj and linear_fc2 (left ones).
        """
        self.rank_for(model.hidden, f"every sketched weight (hidden size {model.hidden})")


def parse_rank(text) -> Union[int, float]:
    """``"16"`` -> 16, ``"0.25"`` -> 0.25 (command-line flags); numbers pass through as they
    are (a YAML config gives ``0.5`` as a float, which must stay a fraction)."""
    if isinstance(text, bool):
        raise UserError(f"--logra-rank must be an integer or a fraction, got {text!r}")
    if isinstance(text, (int, float)):
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise UserError(f"--logra-rank must be an integer or a fraction, got {text!r}") from None


def add_rank_arguments(parser) -> None:
    """``--logra-rank`` and ``--logra-max-rank`` with the trainer's defaults, for the tools and
    jobs that declare their flags with argparse (the planner, the smoke job, the benchmarks);
    :func:`rank_settings` reads them back."""
    parser.add_argument("--logra-rank", default=str(DEFAULT_RANK), metavar="RANK",
                        help=f"LoGRA sketch rank per weight: an integer, or a fraction in (0, 1] of its projected "
                             f"dimension capped at --logra-max-rank (default {DEFAULT_RANK}, the trainer's)")
    parser.add_argument("--logra-max-rank", type=int, default=DEFAULT_MAX_RANK, metavar="MAX_RANK",
                        help=f"the largest rank a fractional --logra-rank gives a weight; 0: no cap "
                             f"(default {DEFAULT_MAX_RANK}, the trainer's)")


def rank_settings(args) -> dict:
    """``rank`` and ``max_rank`` for :class:`LogRAConfig` from :func:`add_rank_arguments`' flags."""
    return {"rank": parse_rank(args.logra_rank), "max_rank": args.logra_max_rank}
