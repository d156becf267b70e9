"""The trainer's configuration: one tree of small component configs.

:class:`TrainConfig` holds one section per component. Every section is a frozen dataclass whose
defaults are written once (on its fields) and validated in its ``__post_init__``; the
command-line flags and YAML keys are derived from the same fields (``logra_megatron/config.py``
via ``logra_megatron/schema.py``). So ``TrainConfig()`` in Python and ``python -m
logra_megatron.train`` with no arguments describe the same run.

Sections defined by their own layer: ``optimizer``, ``lr_schedule``, ``kl``, ``recompute`` (training/config.py),
``logra`` (logra/config.py), ``sampling`` (rollout/types.py), ``advantages``
(rl/advantages.py), ``loss`` (rl/losses.py), ``task`` (rl/tasks/config.py), ``reward``
(rl/rewards.py). The run-level sections are here.

:func:`resolve` turns a TrainConfig into a runnable one: the model config is read once (the
preset, or ``--load``'s ``model_config.json``), the tokenizer's vocabulary is applied, and the
layout is checked against the world size, the task source is built (a JSONL file read, a
reasoning-gym dataset configured) and its prompts formatted, and the reward is chosen (the task's
own unless ``--reward``) and checked against the task, all before any process group starts. What
it built for those checks (the tokenizer, the task source, the prompt format: :class:`RunInputs`)
rides on the config it returns, and the trainer uses them instead of building them again.
"""

import dataclasses
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Optional

from logra_megatron.checkpoint import MODEL_CONFIG_FILE, load_model_config
from logra_megatron.checkpoint_layout import select_checkpoint
from logra_megatron.errors import UserError
from logra_megatron.layout import ParallelLayout
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import PRESETS, ModelConfig
from logra_megatron.models.config import ATTENTION_BACKENDS, resolve_attention_backend
from logra_megatron.rl.advantages import AdvantageConfig
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rl.prompt_format import PromptFormat, build_prompt_format
from logra_megatron.rl.rewards import RewardConfig, check_reward_fits_task
from logra_megatron.rl.tasks import PROVIDES_ANSWER, TaskConfig, TaskSource, build_task_source
from logra_megatron.rl.tokenizers import build_run_tokenizer
from logra_megatron.rollout.engine import ROLLOUT_ENGINES, check_engine_available, engine_syncs_low_rank
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.schema import BadValue, option
from logra_megatron.tokenizer import HUGGINGFACE_TYPES, SENTENCEPIECE_TYPES
from logra_megatron.training.config import KLControlConfig, LRScheduleConfig, OptimizerSettings, RecomputeConfig


SEED_LIMIT = 2**32
"""``--seed`` is below this: every RNG it seeds (Python, NumPy-style, torch, the sampling
streams derived from it) accepts a 32-bit seed."""


def _at_least(config, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise UserError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def _check_output_directory(flag: str, path: Optional[str]) -> None:
    """A directory the run creates or writes into: it may not exist yet, but no file may stand
    where it or one of its parents has to be (found now, not when the run first saves)."""
    if path is None:
        return
    if not path:
        raise UserError(f"{flag} needs a directory (got an empty path)")
    target = existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == target else f"is inside {existing}, which is a file"
        raise UserError(f"{flag} {path} {where}; give a directory")
    # Whether the run can write there, tried (permission bits do not say it: root passes them,
    # and /proc or a read-only mount refuse anyway): a directory made and removed at once.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".logra-write-check-", dir=existing))
    except OSError as error:
        where = "" if existing == target else f" (in {existing})"
        raise UserError(f"{flag} {path}: cannot create a directory there{where}: "
                        f"{error.strerror or error}; give a writable directory") from None


EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")
"""The signals ``--exit-signal`` may name (SIGKILL and SIGSTOP cannot be caught)."""


def parse_exit_signals(text) -> str:
    """``--exit-signal``: comma-separated signal names (``SIGTERM``, ``TERM`` or ``term``), as
    ``SIGTERM,SIGUSR1``; a name outside :data:`EXIT_SIGNALS` is refused."""
    if not isinstance(text, str):
        raise BadValue("must be comma-separated signal names, e.g. SIGTERM,SIGUSR1")
    names = []
    for part in text.split(","):
        name = part.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in EXIT_SIGNALS:
            shown = part.strip()[:24] or "(empty)"
            raise BadValue(f"{shown!r} is not one of {', '.join(EXIT_SIGNALS)}")
        if name not in names:
            names.append(name)
    return ",".join(names)


parse_exit_signals.__name__ = "signal list"


TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""Megatron's ``--transformer-impl`` values; the trainer builds the ``local`` one (Megatron-Core's
own modules, and torch's SDPA for core attention: see ``--attention-backend``)."""
CKPT_FORMATS = ("torch_dist",)
"""Megatron's ``--ckpt-format`` values the trainer reads and writes: ``torch_dist``
(Megatron-Core's ``dist_checkpointing``, Megatron-LM's default), the only format it knows."""


def parse_transformer_impl(text) -> str:
    """``--transformer-impl``: ``local``; ``transformer_engine`` is refused with one line (the
    model builder has no Transformer Engine layer spec)."""
    value = str(text).strip()
    if value == "transformer_engine":
        raise BadValue("transformer_engine is not supported yet: the trainer builds Megatron-Core's local "
                       "layers (pass --transformer-impl local, or leave it out)")
    if value not in TRANSFORMER_IMPLS:
        raise BadValue(f"must be one of {', '.join(TRANSFORMER_IMPLS)}, got {value[:24]!r}")
    return value


parse_transformer_impl.__name__ = "transformer implementation"


def parse_ckpt_format(text) -> str:
    """``--ckpt-format``: ``torch_dist`` only (Megatron's ``torch``, ``zarr``, ``fsdp_dtensor`` are
    refused with one line)."""
    value = str(text).strip()
    if value not in CKPT_FORMATS:
        raise BadValue(f"only torch_dist is supported (the format the trainer reads and writes, Megatron-LM's "
                       f"default), got {value[:24]!r}")
    return value


parse_ckpt_format.__name__ = "checkpoint format"


@dataclass(frozen=True)
class ModelSourceConfig:
    """Which model and tokenizer: a preset (fresh weights), or the checkpoint given by ``--load``
    (its ``model_config.json`` decides the architecture, or in one Megatron-LM wrote its args; a
    converted Hugging Face checkpoint also carries its tokenizer, Megatron-LM's args name theirs)."""

    preset: str = option("tiny", help="model preset when not loading a checkpoint: " + ", ".join(PRESETS))
    tokenizer_type: Optional[str] = option(None, choices=SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES,
                                           help="with --tokenizer-model: a Megatron tokenizer type")
    tokenizer_model: Optional[str] = option(None, help="a SentencePiece .model file or a tokenizer.json (or its folder)")
    bf16: bool = option(False, help="bf16 parameters (fp32 master weights for the dense optimizer; "
                                    "--logra-master decides those of sketched weights)")
    fp16: bool = option(False, help="refused: fp16 needs loss scaling, which the trainer does not implement; "
                                    "use --bf16")
    transformer_impl: str = option("local", parse=parse_transformer_impl,
                                   help="Megatron's layer implementation: local (Megatron-Core's own modules; "
                                        "transformer_engine is not supported yet)")
    untie_embeddings_and_output_weights: bool = option(
        False, help="a separate output layer instead of the input embedding's transpose (default: the preset's "
                    "choice, not Megatron's tied default; with --load the checkpoint's own, and a tied checkpoint "
                    "is refused)")
    num_attention_heads: Optional[int] = option(None, help="attention heads instead of the preset's (head dim = "
                                                           "hidden / heads; vLLM's CPU attention needs >= 32, "
                                                           "e.g. 2 on the tiny preset)")
    num_query_groups: Optional[int] = option(None, help="key/value heads instead of the preset's (default with "
                                                        "--num-attention-heads: as many as heads)")
    attention_backend: str = option("auto", parse=ATTENTION_BACKENDS.parse,
                                    help=ATTENTION_BACKENDS.help("core attention of every layer (the policy's and "
                                                                 "the reference model's)"))

    def __post_init__(self):
        if self.fp16:
            raise UserError("--fp16 is not supported: fp16 training needs loss scaling, which the trainer does not "
                            "implement; use --bf16")
        resolve_attention_backend(self.attention_backend)  # an unknown name is one UserError
        for name in ("num_attention_heads", "num_query_groups"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.preset not in PRESETS:
            raise UserError(f"unknown model preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if (self.tokenizer_type is None) != (self.tokenizer_model is None):
            raise UserError("--tokenizer-type and --tokenizer-model go together")
        if self.tokenizer_model is not None and not os.path.exists(self.tokenizer_model):
            raise UserError(f"tokenizer model not found: {self.tokenizer_model!r} (--tokenizer-model)")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run saves and what it resumes from."""

    load: Optional[str] = option(None, help="a --save directory (resume from its latest complete iteration), "
                                            "or one checkpoint, e.g. converted weights")
    save: Optional[str] = option(None, help="checkpoint directory to save to (one iter_NNNNNNN per save)")
    save_interval: int = option(0, help="save every N RL iterations (0: only at the end, with --save)")
    ckpt_step: Optional[int] = option(None, help="with --load: this iteration instead of the latest complete one")
    keep_checkpoints: int = option(0, help="keep only the newest N iterations under --save (0: all)")
    ckpt_format: str = option("torch_dist", parse=parse_ckpt_format,
                              help="checkpoint format: torch_dist (Megatron-Core dist_checkpointing, the only one)")
    use_checkpoint_args: bool = option(
        False, help="accepted for Megatron command lines: with --load the model's architecture is always the "
                    "checkpoint's (its model_config.json, or for a checkpoint Megatron-LM wrote the args in its "
                    "common state), whether or not this is given")
    load_optim: bool = option(True, flag="--no-load-optim", negative=True,
                              help="with --load: the weights (and trainer state) only, fresh optimizer and KL "
                                   "controller state (e.g. a dense run's checkpoint into a LoGRA run)")

    def __post_init__(self):
        _at_least(self, 0, "save_interval", "keep_checkpoints")
        if self.ckpt_step is not None:
            _at_least(self, 0, "ckpt_step")
            if self.load is None:
                raise UserError("--ckpt-step needs --load")
        # --load may name the --save directory before its first save (a job that restarts itself).
        if self.load == "":
            raise UserError("--load needs a checkpoint directory (got an empty path)")
        if self.load is not None and not os.path.isdir(self.load) and self.load != self.save:
            what = "it is a file" if os.path.isfile(self.load) else "no such directory"
            raise UserError(f"--load: checkpoint directory not found: {self.load!r} ({what})")
        _check_output_directory("--save", self.save)


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism; the data-parallel size is what the world size leaves."""

    tensor_model_parallel_size: int = option(1, help="ranks that split every linear layer")
    pipeline_model_parallel_size: int = option(1, help="pipeline stages (the layers are divided evenly)")
    overlap_grad_reduce: bool = option(
        False, help="Megatron's: the data-parallel gradient reduction in buckets during the backward; with LoGRA "
                    "the sketches' too (each bucket's all-reduce starts when its layers' backward is done)")
    overlap_param_gather: bool = option(
        False, help="Megatron's (with --use-distributed-optimizer and --overlap-grad-reduce): the updated dense "
                    "weights' all-gather runs bucket by bucket ahead of the next forward, not inside the step; "
                    "sketched weights are updated in place on every rank and never gathered")
    sequence_parallel: bool = option(
        False, help="Megatron's: with --tensor-model-parallel-size > 1, the activations outside the tensor-"
                    "parallel linears (layer norms, dropout, residuals) are split along the sequence over the "
                    "TP ranks; the linears all-gather their input and reduce-scatter their output (the "
                    "sketching linears too). Sampling runs without it (one token per decode step)")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, help="Megatron's interleaved pipeline (--pipeline-model-parallel-size > 1): each pipeline rank "
                   "holds several model chunks of this many layers, run by Megatron's interleaved schedule")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, help="Megatron's newer name for the same: this many model chunks per pipeline rank (give one "
                   "of the two)")

    def __post_init__(self):
        _at_least(self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise UserError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                            f"over the tensor-parallel ranks), got {self.tensor_model_parallel_size}")
        virtual = [name for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
                   if getattr(self, name) is not None]
        if len(virtual) == 2:
            raise UserError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                            "say the same thing two ways; give one of them")
        if virtual:
            _at_least(self, 1, virtual[0])
            if self.pipeline_model_parallel_size < 2:
                raise UserError(f"--{virtual[0].replace('_', '-')} needs --pipeline-model-parallel-size > 1 "
                                f"(it splits each pipeline stage into chunks), got {self.pipeline_model_parallel_size}")

    def virtual_pipeline(self, layers: int) -> Optional[int]:
        """Model chunks per pipeline rank for a model of ``layers`` layers (None: no virtual
        pipeline), as Megatron derives it from either flag; one error line when the flag does not
        divide a stage's layers."""
        per_stage = layers // self.pipeline_model_parallel_size
        if self.num_layers_per_virtual_pipeline_stage is not None:
            flag, value = "--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage
        elif self.num_virtual_stages_per_pipeline_rank is not None:
            flag, value = "--num-virtual-stages-per-pipeline-rank", self.num_virtual_stages_per_pipeline_rank
        else:
            return None
        if per_stage % value:
            raise UserError(f"{flag} {value} must divide the {per_stage} layers of a pipeline stage ({layers} layers "
                            f"over --pipeline-model-parallel-size {self.pipeline_model_parallel_size})")
        # layers per chunk, or chunks per rank
        return per_stage // value if self.num_layers_per_virtual_pipeline_stage is not None else value


DEFAULT_PROMPTS_PER_STEP = 16


@dataclass(frozen=True)
class RolloutConfig:
    """How many prompts each step samples, and with which engine."""

    engine: str = option("megatron", flag="--rollout-engine", parse=ROLLOUT_ENGINES.parse,
                         help=ROLLOUT_ENGINES.help("rollout engine"))
    prompts_per_step: Optional[int] = option(
        None, help=f"prompts per optimizer step (the global batch is prompts x --group-size sequences; default: "
                   f"--global-batch-size / --group-size, else {DEFAULT_PROMPTS_PER_STEP})")
    global_batch_size: Optional[int] = option(
        None, help="Megatron's global batch: rollout rows (sequences) per step, over all data-parallel replicas; "
                   "alone it sets --prompts-per-step to itself / --group-size, with --prompts-per-step they must "
                   "agree")
    seq_length: Optional[int] = option(
        None, help="Megatron's sequence length: the cap on prompt + response tokens of a rollout (the longest "
                   "prompt + --max-new-tokens must fit it); at most the model's max sequence length, which is the "
                   "cap without it")
    sync_bucket_mb: int = option(512, help="weight sync into a remote rollout engine (vllm): MiB of "
                                           "tensors converted and handed over at a time")
    policy_sync: str = option("full", choices=("full", "lowrank"),
                              help="weight sync into a remote rollout engine (vllm): full (every weight) or "
                                   "lowrank (LoGRA's factors of the steps since the last sync, applied by the "
                                   "engine; a full sync at each projection refresh)")
    full_sync_interval: int = option(10, help="with --policy-sync lowrank: a full sync at least every this "
                                              "many syncs, bounding the engine's drift")

    def __post_init__(self):
        ROLLOUT_ENGINES.check(self.engine)
        check_engine_available(self.engine)
        if self.policy_sync == "lowrank" and not engine_syncs_low_rank(self.engine):
            raise UserError(f"--policy-sync lowrank updates a rollout engine's own weights: it needs "
                            f"--rollout-engine vllm or another remote engine (the {self.engine} engine "
                            "samples from the trainer's weights)")
        _at_least(self, 1, "sync_bucket_mb", "full_sync_interval")
        for name in ("prompts_per_step", "global_batch_size", "seq_length"):
            if getattr(self, name) is not None:
                _at_least(self, 1, name)

    def with_group_size(self, group_size: int) -> "RolloutConfig":
        """The prompts per step, from what the user gave: Megatron's ``--global-batch-size``
        counts rollout rows, ``--prompts-per-step`` prompts of ``group_size`` rows each
        (``global_batch_size`` stays as given: :attr:`TrainConfig.global_batch_size` is the
        resolved one)."""
        prompts, rows = self.prompts_per_step, self.global_batch_size
        if rows is not None:
            if rows % group_size:
                raise UserError(f"--global-batch-size {rows} must be a multiple of --group-size {group_size} "
                                f"(each prompt is sampled --group-size times)")
            if prompts is not None and prompts * group_size != rows:
                raise UserError(f"--global-batch-size {rows} and --prompts-per-step {prompts} disagree: the global "
                                f"batch is --prompts-per-step x --group-size = {prompts} x {group_size} = "
                                f"{prompts * group_size} rollout rows; give one of them")
            prompts = rows // group_size
        prompts = DEFAULT_PROMPTS_PER_STEP if prompts is None else prompts
        return dataclasses.replace(self, prompts_per_step=prompts)


DEFAULT_WARMUP_ITERS = 150


@dataclass(frozen=True)
class WarmupConfig:
    """The supervised warm-up before RL: teaches the answer format so RL has reward to work with
    (answer tokens only, on training prompts)."""

    iters: Optional[int] = option(
        None, flag="--warmup-iters",
        help=f"supervised warm-up steps before RL (0: RL from the start; default: {DEFAULT_WARMUP_ITERS} on a "
             f"preset's fresh weights, 0 with --load: the warm-up teaches the embedded toy model the answer "
             f"format, a pretrained or converted checkpoint starts RL at once)")
    lr: float = option(3e-3, flag="--warmup-lr", help="learning rate of the warm-up")
    min_lr: Optional[float] = option(None, flag="--warmup-min-lr",
                                     help="cosine-decay the warm-up's lr to this (default: constant)")

    def __post_init__(self):
        if self.iters is not None and self.iters < 0:
            raise UserError(f"--warmup-iters must be >= 0, got {self.iters}")
        if self.lr < 0:
            raise UserError(f"--warmup-lr must be >= 0, got {self.lr}")
        if self.min_lr is not None and not 0.0 <= self.min_lr <= self.lr:
            raise UserError(f"--warmup-min-lr must be between 0 and --warmup-lr ({self.lr}), got {self.min_lr}")


@dataclass(frozen=True)
class RunConfig:
    """What the run does around the steps: length, seed, batching, evaluation, logging."""

    train_iters: int = option(500, help="RL iterations (optimizer steps); 0: the supervised warm-up alone, e.g. "
                                        "with --save to give several runs one warmed-up start "
                                        "(each loads it with --load DIR --no-load-optim)")
    seed: int = option(1234, help="seeds the weights, projections, prompts and sampling")
    micro_batch_size: int = option(16, help="sequences per forward/backward")
    # --- packed sequences (issue 33) ---
    pack_sequences: bool = option(True, flag="--no-pack-sequences", negative=True,
                                  help="pad every row of the GRPO log-prob and policy-loss passes to the batch's "
                                       "longest row ([B, 1, S, S] mask) instead of packing rows end to end "
                                       "(cu_seqlens, no padding; needs --attention-backend sdpa or auto)")
    max_tokens_per_microbatch: int = option(0, help="packed sequences: real tokens per microbatch, rows "
                                                    "bin-packed up to it (a longer row alone); 0: "
                                                    "--micro-batch-size x the batch's padded length")
    balance_batch: bool = option(True, flag="--no-balance-batch", negative=True,
                                 help="keep each data-parallel replica's own rollouts instead of spreading the "
                                      "step's rows over the replicas by token count (rl/balancing.py; exact: "
                                      "each optimizer step sees the same rows)")
    eval_prompts: int = option(150, help="held-out prompts (never trained on) for the greedy accuracy")
    eval_samples: int = option(0, help="also sample this many completions per held-out prompt (at --temperature) "
                                       "and report pass@k with the unbiased estimator (0: greedy pass@1 only)")
    exit_interval: int = option(0, help="stop (saving with --save) when the iteration is a multiple of this")
    output_dir: str = option("", help="metrics.jsonl, TensorBoard and summary.json (default: runs/<timestamp>)")
    tensorboard_dir: Optional[str] = option(None, help="default: <output-dir>/tensorboard")
    log_interval: int = option(1, help="without the progress bar: one line every N steps")
    progress: bool = option(True, flag="--no-progress", negative=True, help="no progress bar (logs, CI)")
    max_consecutive_skips: int = option(10, help="stop (saving with --save) after N steps in a row skipped for "
                                                 "a non-finite loss, gradient or KL forecast (0: never)")
    exit_signal_handler: bool = option(
        True, flag="--no-exit-signal-handler", negative=True, positive_flag="--exit-signal-handler",
        help="end at once on SIGTERM/SIGUSR1 (the signals' default action); by default, as Megatron's "
             "--exit-signal-handler, such a signal (SLURM, Kubernetes, torchrun before a kill) lets the RL step "
             "in flight finish, saves it (with --save) and exits 0")
    exit_signal: str = option("SIGTERM,SIGUSR1", parse=parse_exit_signals,
                              help="the signals that stop the run after the step in flight (comma-separated)")
    wandb_project: Optional[str] = option(None, help="also log the metrics to a wandb run of this project, in "
                                                     "wandb's offline mode (upload with `wandb sync`); needs "
                                                     "pip install wandb")
    wandb_exp_name: Optional[str] = option(None, help="with --wandb-project: the wandb run's name (default: "
                                                      "the name of --output-dir)")
    wandb_save_dir: Optional[str] = option(None, help="with --wandb-project: where wandb writes the run "
                                                      "(default: <output-dir>/wandb)")

    def __post_init__(self):
        _at_least(self, 1, "micro_batch_size", "eval_prompts", "log_interval")
        _at_least(self, 0, "train_iters", "exit_interval", "max_consecutive_skips", "seed", "eval_samples",
                  "max_tokens_per_microbatch")
        if self.seed >= SEED_LIMIT:
            raise UserError(f"--seed must be below 2**32 = {SEED_LIMIT}, got {self.seed}")
        _check_output_directory("--output-dir", self.output_dir or None)
        _check_output_directory("--tensorboard-dir", self.tensorboard_dir)
        self._check_wandb()

    def _check_wandb(self) -> None:
        if self.wandb_project is None:
            if self.wandb_exp_name is not None or self.wandb_save_dir is not None:
                raise UserError("--wandb-exp-name and --wandb-save-dir need --wandb-project")
            return
        if not self.wandb_project:
            raise UserError("--wandb-project needs a project name (got an empty one)")
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise UserError("--wandb-project needs wandb, which is not installed: pip install wandb (or "
                            "pip install -e .[wandb]); TensorBoard and metrics.jsonl log without it")
        _check_output_directory("--wandb-save-dir", self.wandb_save_dir)

    def wandb_settings(self, output_dir: str) -> Optional[dict]:
        """``wandb.init``'s project, name and dir for ``--wandb-*`` (None without
        ``--wandb-project``), as Megatron-LM passes them."""
        if self.wandb_project is None:
            return None
        return {"project": self.wandb_project,
                "name": self.wandb_exp_name or os.path.basename(os.path.normpath(output_dir)),
                "dir": self.wandb_save_dir or os.path.join(output_dir, "wandb")}


@dataclass(frozen=True)
class TrainConfig:
    """The whole run, one section per component (see the module docstring)."""

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    logra: LogRAConfig = field(default_factory=LogRAConfig)
    kl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model_config: Optional[ModelConfig] = None
    """The resolved architecture (set by :func:`resolve`; None until then)."""
    load_dir: Optional[str] = None
    """The checkpoint directory ``--load`` resolves to (an ``iter_NNNNNNN`` or a single
    checkpoint; set by :func:`resolve`; None: nothing to load)."""

    def __post_init__(self):
        # Checks that span sections. Seeds derive from --seed, so every component that draws
        # random numbers follows the one flag.
        if self.sampling.temperature <= 0:
            raise UserError("--temperature must be > 0 for RL sampling")
        if not self.lr_schedule.min_lr <= self.optimizer.lr:
            raise UserError(f"--min-lr must be between 0 and --lr ({self.optimizer.lr}), got {self.lr_schedule.min_lr}")
        seed = self.run.seed
        if self.logra.seed != seed:
            object.__setattr__(self, "logra", dataclasses.replace(self.logra, seed=seed))
        if self.task.seed != seed:
            object.__setattr__(self, "task", dataclasses.replace(self.task, seed=seed))
        if self.rollout.policy_sync == "lowrank" and not self.optimizer.sketched:
            raise UserError(f"--policy-sync lowrank sends LoGRA's low-rank steps: it needs --optimizer logra, "
                            f"got {self.optimizer.kind}")
        if self.logra.master == "bf16-sr" and not self.model.bf16:
            raise UserError("--logra-master bf16-sr rounds into bf16 weights: it needs --bf16")
        if self.parallel.sequence_parallel and self.logra.embeddings and self.optimizer.sketched:
            raise UserError("--logra-embeddings does not run under --sequence-parallel (the sketched embedding "
                            "takes no sequence-parallel output); drop one of them")
        if self.parallel.overlap_param_gather and not (self.optimizer.distributed and self.parallel.overlap_grad_reduce):
            raise UserError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
                            "(as Megatron-LM's)")
        if self.logra.zero1 != self.optimizer.distributed:
            object.__setattr__(self, "logra", dataclasses.replace(self.logra, zero1=self.optimizer.distributed))
        # --global-batch-size counts rows, --prompts-per-step prompts: one number decides both.
        object.__setattr__(self, "rollout", self.rollout.with_group_size(self.advantages.group_size))
        self.lr_schedule.check_iters(self.run.train_iters)

    @property
    def global_batch_size(self) -> int:
        """Rollout rows per step over all replicas (Megatron's ``--global-batch-size``)."""
        return self.rollout.prompts_per_step * self.advantages.group_size

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.model.bf16 else "fp32"

    @property
    def inputs(self) -> Optional["RunInputs"]:
        """The tokenizer, task source and prompt format :func:`resolve` built for this config;
        None on any other config (``TrainConfig()``, or a ``dataclasses.replace`` of a resolved
        one, whose sections may differ: :func:`run_inputs` builds them then). Kept outside the
        dataclass fields: they are built objects, not settings (equality, ``fields()`` and the
        flag schema see settings only)."""
        return self.__dict__.get(_INPUTS_ATTRIBUTE)


_INPUTS_ATTRIBUTE = "_run_inputs"


@dataclass(frozen=True)
class RunInputs:
    """What a run builds from its flags before any process group: built once, by :func:`resolve`
    (which needs them to check the flags), and handed to the trainer on the resolved config. A
    task source may read a file or generate a dataset, a tokenizer load a model."""

    tokenizer: object
    """The run's :class:`~logra_megatron.tokenizer.Tokenizer` (rl/tokenizers.py)."""
    tasks: TaskSource
    prompt_format: PromptFormat


def run_inputs(config: TrainConfig) -> RunInputs:
    """The :class:`RunInputs` of a resolved ``config``: those :func:`resolve` built, else (a config
    changed since, see :attr:`TrainConfig.inputs`) built now."""
    if config.inputs is not None:
        return config.inputs
    return _task_inputs(config.task, build_run_tokenizer(config.model, config.load_dir))


def replace_settings(config: TrainConfig, **changes) -> TrainConfig:
    """``dataclasses.replace(config, **changes)`` that keeps what :func:`resolve` built when the
    sections it was built from (the task, the model and where it loads from) are not among the
    changes: evaluation changes only its checkpoint and run sections, and builds nothing twice."""
    changed = dataclasses.replace(config, **changes)
    if config.inputs is not None and not changes.keys() & {"task", "model", "model_config", "load_dir"}:
        object.__setattr__(changed, _INPUTS_ATTRIBUTE, config.inputs)
    return changed


def _task_inputs(task: TaskConfig, tokenizer) -> RunInputs:
    """The task source ``task`` names and its prompt format, beside ``tokenizer``."""
    source = build_task_source(task)
    return RunInputs(tokenizer, source, build_prompt_format(task, source, tokenizer))


def _preset_with_heads(source: ModelSourceConfig) -> ModelConfig:
    """The preset, with ``--num-attention-heads`` / ``--num-query-groups`` when given."""
    model = PRESETS[source.preset]
    heads, groups = source.num_attention_heads, source.num_query_groups
    if heads is None and groups is None:
        return model
    heads = heads or model.heads
    groups = groups or (heads if source.num_attention_heads is not None else model.kv_heads)
    if model.hidden % heads:
        raise UserError(f"--num-attention-heads {heads} must divide the hidden size {model.hidden} of preset "
                        f"{source.preset!r}")
    if heads % groups:
        raise UserError(f"--num-attention-heads {heads} must be a multiple of --num-query-groups {groups}")
    return model.with_changes(heads=heads, kv_heads=groups)


VLLM_CPU_MIN_HEAD_DIM = 32
"""vLLM's CPU attention has kernels for head dims 32, 64, 80, ... only."""


def heads_for_the_engine(config: TrainConfig, model: ModelConfig) -> ModelConfig:
    """The preset, or with ``--rollout-engine vllm`` on a machine without CUDA and a preset whose
    heads are narrower than vLLM's CPU attention serves (the tiny preset: 4 heads of 16), the
    preset with heads of 32 (what ``--num-attention-heads hidden/32`` gives: as many kv heads as
    heads), so that the embedded default runs with vLLM as it is. Heads given on the command
    line are kept (the engine then says what it cannot serve)."""
    if (config.rollout.engine != "vllm" or config.model.num_attention_heads is not None
            or config.model.num_query_groups is not None or model.kv_channels >= VLLM_CPU_MIN_HEAD_DIM
            or model.hidden % VLLM_CPU_MIN_HEAD_DIM):
        return model
    import torch

    if torch.cuda.is_available():
        return model
    heads = model.hidden // VLLM_CPU_MIN_HEAD_DIM
    return model.with_changes(heads=heads, kv_heads=heads)


def widened_heads_line(config: TrainConfig) -> Optional[str]:
    """What the run says when :func:`heads_for_the_engine` changed the preset's heads (a
    resolved ``config``); None when it did not."""
    model = config.model_config
    preset = PRESETS[config.model.preset]
    if config.load_dir or config.model.num_attention_heads is not None or model.heads == preset.heads:
        return None
    return (f"model: preset {config.model.preset!r} with {model.heads} attention heads of {model.kv_channels} "
            f"instead of {preset.heads} of {preset.kv_channels} (vLLM's CPU attention has no kernel for head dim "
            f"{preset.kv_channels}; --rollout-engine megatron keeps the preset's)")


def resolve(config: TrainConfig, world_size: Optional[int] = None) -> TrainConfig:
    """The config with its model resolved once and checked against the layout (no process
    group needed). ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    config = _resume_after_restart(config)
    load_dir = _checkpoint_to_load(config.checkpoint)
    if load_dir is not None:
        if config.model.num_attention_heads is not None or config.model.num_query_groups is not None:
            raise UserError("--num-attention-heads/--num-query-groups change a preset; a checkpoint (--load) "
                            "keeps its own architecture")
        model = _read_model_config(load_dir)  # a checkpoint decides its own architecture
    else:
        model = heads_for_the_engine(config, _preset_with_heads(config.model))
    tokenizer = build_run_tokenizer(config.model, load_dir)
    if load_dir is None and config.model.preset == "tiny":
        # Fresh weights of the toy preset: as many embedding rows as the tokenizer has ids (the
        # embedded tokenizer's, or a --tokenizer-model's, as Megatron sizes a fresh model's vocabulary).
        model = model.with_changes(vocab=tokenizer.vocab_size)
    if tokenizer.vocab_size > model.vocab:
        raise UserError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {model.vocab}")
    model = _untied(config.model, model, load_dir)
    if config.warmup.iters is None:  # the warm-up teaches a fresh preset the format; a checkpoint needs none
        config = dataclasses.replace(config, warmup=dataclasses.replace(
            config.warmup, iters=0 if load_dir is not None else DEFAULT_WARMUP_ITERS))
    if config.optimizer.sketched:
        config.logra.check_model(model)
    world_size = _world_size() if world_size is None else world_size
    if world_size < 1:
        raise UserError(f"the world size must be >= 1, got {world_size}")
    layout = ParallelLayout(config.parallel.tensor_model_parallel_size,
                            config.parallel.pipeline_model_parallel_size, world_size)
    name = config.model.preset if load_dir is None else load_dir
    layout.check_model(model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab, name)
    virtual = config.parallel.virtual_pipeline(model.layers)
    config.recompute.check_layers(model.layers // layout.pipeline_parallel // (virtual or 1))
    if virtual and config.rollout.engine != "megatron":
        raise UserError(f"--rollout-engine {config.rollout.engine} does not take the interleaved pipeline's model "
                        "chunks (--num-layers-per-virtual-pipeline-stage); use --rollout-engine megatron")
    if config.rollout.prompts_per_step % layout.data_parallel:
        raise UserError(f"--prompts-per-step {config.rollout.prompts_per_step} must be a multiple of the "
                        f"data-parallel size {layout.data_parallel}")
    _check_micro_batch(config, layout.data_parallel)
    inputs = _task_inputs(config.task, tokenizer)
    source, prompt_format = inputs.tasks, inputs.prompt_format
    reward = _resolve_reward(config, source, prompt_format)
    _check_task_supply(config, source)
    _check_sequence_length(config, tokenizer, model, name, source, prompt_format)
    resolved = dataclasses.replace(config, model_config=model, load_dir=load_dir, reward=reward)
    # What the checks built is what the run uses (the trainer: rl/trainer.py build): built once.
    object.__setattr__(resolved, _INPUTS_ATTRIBUTE, inputs)
    return resolved


def _untied(source: ModelSourceConfig, model: ModelConfig, load_dir: Optional[str]) -> ModelConfig:
    """``--untie-embeddings-and-output-weights``: a preset gets a separate output layer; a
    checkpoint keeps its own (a tied one cannot be untied by a flag: it has no output weights)."""
    if not source.untie_embeddings_and_output_weights or not model.tie_embeddings:
        return model
    if load_dir is not None:
        raise UserError(f"--untie-embeddings-and-output-weights: the checkpoint {load_dir} ties its embeddings "
                        f"(it holds no separate output layer); leave the flag out")
    return model.with_changes(tie_embeddings=False)


def lr_phases_line(config: TrainConfig) -> str:
    """Which lr governs which phase, as the start-up summary says it (a resolved ``config``)."""
    warmup, schedule = config.warmup, config.lr_schedule
    if warmup.iters:
        shape = "constant" if warmup.min_lr is None else f"cosine to --warmup-min-lr {warmup.min_lr:g}"
        first = f"supervised warm-up {warmup.iters} steps at --warmup-lr {warmup.lr:g} ({shape})"
    else:
        why = "a checkpoint is loaded" if config.load_dir else "--warmup-iters 0"
        first = f"no supervised warm-up ({why})"
    decay_iters = schedule.decay_iters(config.run.train_iters)
    style = schedule.lr_decay_style
    if style == "WSD":
        style = (f"WSD: constant, then {schedule.lr_wsd_decay_style} over the last {schedule.lr_wsd_decay_iters} "
                 f"of {decay_iters} iters")
    elif style != "constant":
        style = f"{style} over {decay_iters} iters"
    warm = f", linear warm-up {schedule.lr_warmup_iters} iters" if schedule.lr_warmup_iters else ""
    return (f"lr: {first}; RL {config.run.train_iters} iters at --lr {config.optimizer.lr:g} ({style} to --min-lr "
            f"{schedule.min_lr:g}{warm}), weight decay {config.optimizer.weight_decay:g}")


def _world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(text)
    except ValueError:
        raise UserError(f"WORLD_SIZE must be a whole number of ranks (torchrun sets it), got {text!r}") from None


def _read_model_config(directory: str) -> ModelConfig:
    """``--load``'s architecture. A ``model_config.json`` that is not a JSON object, misses or
    adds fields or gives one a value of the wrong type is a :class:`UserError` naming the file
    and the field (not a JSON or type error from deep inside, nor a wrong value found only when
    the model is built)."""
    path = os.path.join(directory, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        return load_model_config(directory)  # Megatron-LM's args (checkpoint_args.py), or says what is missing
    try:
        with open(path, "rb") as handle:
            values = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
        raise UserError(f"--load: {path} is not valid JSON ({str(error).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise UserError(f"--load: {path} must hold a JSON object of model fields, not {type(values).__name__}")
    hints = typing.get_type_hints(ModelConfig)
    for item in dataclasses.fields(ModelConfig):
        if item.name not in values:
            if item.default is dataclasses.MISSING:
                raise UserError(f"--load: {path} misses the model field {item.name!r}")
            continue
        value, allowed = values[item.name], typing.get_args(hints[item.name]) or (hints[item.name],)
        if isinstance(value, bool):
            ok = bool in allowed
        else:  # an int is a valid float (JSON writes 10000.0 as 10000 too)
            ok = isinstance(value, allowed) or (float in allowed and isinstance(value, int))
        if not ok:
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
            raise UserError(f"--load: {path}: {item.name} must be {names}, got {value!r}")
    try:
        return load_model_config(directory)
    except UserError as error:  # unknown fields, inconsistent sizes
        raise UserError(f"--load: {path} is not a valid model config: {error}") from None


def _check_micro_batch(config: TrainConfig, data_parallel: int) -> None:
    """Each data-parallel replica trains on ``prompts / DP x group`` sequences a step (and the
    supervised warm-up on as many); Megatron's schedule splits them into equal micro-batches."""
    per_replica = config.rollout.prompts_per_step // data_parallel * config.advantages.group_size
    micro = config.run.micro_batch_size
    if micro < per_replica and per_replica % micro:
        raise UserError(
            f"--micro-batch-size {micro} must divide the {per_replica} sequences each data-parallel replica "
            f"trains on per step (--prompts-per-step {config.rollout.prompts_per_step} / data-parallel size "
            f"{data_parallel} x --group-size {config.advantages.group_size}), or be at least that many")


def _resolve_reward(config: TrainConfig, source: TaskSource, prompt_format: PromptFormat) -> RewardConfig:
    """The task decides the reward unless ``--reward`` names one; either way it must fit the
    task's records (``--reward gsm_symbolic`` cannot score arithmetic prompts), and the
    supervised warm-up needs reference answers."""
    name = config.reward.name or source.default_reward(prompt_format.chat)
    check_reward_fits_task(name, source.name, source.provides)
    if config.warmup.iters and PROVIDES_ANSWER not in source.provides:
        raise UserError(f"--task {source.name} has no reference answers for the supervised warm-up; "
                        f"pass --warmup-iters 0")
    return dataclasses.replace(config.reward, name=name)


def _check_task_supply(config: TrainConfig, source: TaskSource) -> None:
    """The task must have enough distinct problems on each side of its split for what the run
    asks: ``--eval-prompts`` held-out ones, ``--prompts-per-step`` training ones a step (x
    ``--group-size`` for the supervised warm-up). Found now, not after the model is built."""
    needs = [("held-out", "--eval-prompts", config.run.eval_prompts),
             ("training", "--prompts-per-step", config.rollout.prompts_per_step)]
    if config.warmup.iters:
        needs.append(("training", "--prompts-per-step x --group-size (the supervised warm-up's batch)",
                      config.rollout.prompts_per_step * config.advantages.group_size))
    source.check_supply(needs)


def _check_sequence_length(config: TrainConfig, tokenizer, model: ModelConfig, name: str, source: TaskSource,
                           prompt_format: PromptFormat) -> None:
    """The longest prompt of the task (as the policy sees it, chat template included) plus
    ``--max-new-tokens`` must fit the model's sequence length (the rollout engine's rule), checked
    on the prompts the source says bound it (the arithmetic task's widest problems, every record
    of a file, a generator's evaluation set and first batch)."""
    probe = source.length_probe(config.run.eval_prompts, config.rollout.prompts_per_step)
    longest = max(len(tokenizer.encode(prompt_format.prompt(record))) for record in probe)
    new = config.sampling.max_new_tokens
    cap = config.rollout.seq_length
    if cap is not None and cap > model.max_seq:
        raise UserError(f"--seq-length {cap} exceeds the max sequence length {model.max_seq} of {name}")
    if longest + new > (model.max_seq if cap is None else cap):
        hint = " (or --max-operand)" if config.task.name == "arithmetic" else ""
        if cap is not None:
            raise UserError(f"--max-new-tokens {new} + the longest prompt ({longest} tokens) exceeds --seq-length "
                            f"{cap}; lower --max-new-tokens{hint} or raise --seq-length")
        raise UserError(
            f"--max-new-tokens {new} + the longest prompt ({longest} tokens) exceeds the max sequence length "
            f"{model.max_seq} of {name}; lower --max-new-tokens{hint}")


def _restart_count() -> int:
    """Which attempt of a torchrun job this is (``TORCHELASTIC_RESTART_COUNT``; 0 without torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _resume_after_restart(config: TrainConfig) -> TrainConfig:
    """A job torchrun restarted (``--max-restarts``) continues where it saved: with ``--save`` and
    no ``--load``, the restarted attempt loads the newest complete checkpoint under ``--save``
    (as ``--load`` = ``--save`` would), or starts over when the attempts before saved nothing.
    Without this, the restart would begin again at step 0 and overwrite what they saved."""
    attempt, checkpoint = _restart_count(), config.checkpoint
    if attempt < 1 or checkpoint.load is not None:
        return config
    loud = os.environ.get("RANK", "0") == "0"
    if not checkpoint.save:
        if loud:
            print(f"torchrun restart {attempt}: no --save, so nothing to resume from; the run starts over", flush=True)
        return config
    if loud:
        chosen = select_checkpoint(checkpoint.save, warn=lambda message: None) if os.path.isdir(checkpoint.save) else None
        where = f"resuming from {chosen[1]}" if chosen else "nothing saved there yet, so the run starts over"
        print(f"torchrun restart {attempt}: no --load given, so the newest complete checkpoint under --save "
              f"{checkpoint.save}: {where}", flush=True)
    return dataclasses.replace(config, checkpoint=dataclasses.replace(checkpoint, load=checkpoint.save))


def _checkpoint_to_load(checkpoint: CheckpointConfig) -> Optional[str]:
    """The directory ``--load`` (``--ckpt-step``) means. A --load that is also the --save
    directory and holds nothing yet starts the run from scratch (a job that restarts itself
    passes both from the start); any other --load without a checkpoint is an error."""
    if checkpoint.load is None:
        return None
    quiet = os.environ.get("RANK", "0") != "0"  # every rank resolves; the first one warns
    chosen = select_checkpoint(checkpoint.load, checkpoint.ckpt_step, warn=(lambda message: None) if quiet else print)
    if chosen is not None:
        return chosen[1]
    if checkpoint.load != checkpoint.save:
        raise UserError(f"no checkpoint in {checkpoint.load} (no iter_NNNNNNN directory, no {MODEL_CONFIG_FILE})")
    return None
