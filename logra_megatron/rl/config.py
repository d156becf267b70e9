"""The trainer's configuration: one tree of small component configs.

:class:`TrainConfig` holds one section per component. Every section is a frozen dataclass whose
defaults are written once (on its fields) and validated in its ``__post_init__``; the
command-line flags and YAML keys are derived from the same fields (``logra_megatron/config.py``
via ``logra_megatron/schema.py``). So ``TrainConfig()`` in Python and ``python -m
logra_megatron.train`` with no arguments describe the same run.

Sections defined by their own layer: ``optimizer``, ``lr_schedule``, ``kl`` (training/config.py),
``logra`` (logra/config.py), ``sampling`` (rollout/types.py), ``advantages``
(rl/advantages.py), ``loss`` (rl/losses.py), ``task`` (rl/tasks.py), ``reward``
(rl/rewards.py). The run-level sections are here.

:func:`resolve` turns a TrainConfig into a runnable one: the model config is read once (the
preset, or ``--load``'s ``model_config.json``), the tokenizer's vocabulary is applied, and the
layout is checked against the world size, all before any process group starts.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from logra_megatron.checkpoint import load_model_config
from logra_megatron.errors import UserError
from logra_megatron.layout import ParallelLayout
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import PRESETS, ModelConfig
from logra_megatron.rl.advantages import AdvantageConfig
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rl.rewards import RewardConfig
from logra_megatron.rl.tasks import ArithmeticTaskConfig
from logra_megatron.rl.tokenizers import build_run_tokenizer
from logra_megatron.rollout.engine import ROLLOUT_ENGINES
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.schema import option
from logra_megatron.tokenizer import HUGGINGFACE_TYPES, SENTENCEPIECE_TYPES
from logra_megatron.training.config import KLControlConfig, LRScheduleConfig, OptimizerSettings


def _at_least(config, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise UserError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ModelSourceConfig:
    """Which model and tokenizer: a preset (fresh weights), or the checkpoint given by ``--load``
    (its ``model_config.json`` decides the architecture; a converted Hugging Face checkpoint
    also carries its tokenizer)."""

    preset: str = option("tiny", help="model preset when not loading a checkpoint: " + ", ".join(PRESETS))
    tokenizer_type: Optional[str] = option(None, choices=SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES,
                                           help="with --tokenizer-model: a Megatron tokenizer type")
    tokenizer_model: Optional[str] = option(None, help="a SentencePiece .model file or a tokenizer.json (or its folder)")
    bf16: bool = option(False, help="bf16 parameters (fp32 master weights for the dense optimizer; "
                                    "--logra-master decides those of sketched weights)")

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise UserError(f"unknown model preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if (self.tokenizer_type is None) != (self.tokenizer_model is None):
            raise UserError("--tokenizer-type and --tokenizer-model go together")
        if self.tokenizer_model is not None and not os.path.exists(self.tokenizer_model):
            raise UserError(f"tokenizer model not found: {self.tokenizer_model}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run saves and what it resumes from."""

    load: Optional[str] = option(None, help="a checkpoint directory: resume a run, or start from converted weights")
    save: Optional[str] = option(None, help="checkpoint directory to save to")
    save_interval: int = option(0, help="save every N RL iterations (0: only at the end, with --save)")

    def __post_init__(self):
        _at_least(self, 0, "save_interval")
        if self.load is not None and not os.path.isdir(self.load):
            raise UserError(f"checkpoint directory not found: {self.load}")


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism; the data-parallel size is what the world size leaves."""

    tensor_model_parallel_size: int = option(1, help="ranks that split every linear layer")
    pipeline_model_parallel_size: int = option(1, help="pipeline stages (the layers are divided evenly)")

    def __post_init__(self):
        _at_least(self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size")


@dataclass(frozen=True)
class RolloutConfig:
    """How many prompts each step samples, and with which engine."""

    engine: str = option("megatron", flag="--rollout-engine", choices=tuple(ROLLOUT_ENGINES),
                         help="rollout engine: megatron (KV-cache generation on the trainer's own model)")
    prompts_per_step: int = option(16, help="prompts per optimizer step (the global batch is prompts x "
                                            "--group-size sequences)")

    def __post_init__(self):
        if self.engine not in ROLLOUT_ENGINES:
            raise UserError(f"--rollout-engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {self.engine!r}")
        _at_least(self, 1, "prompts_per_step")


@dataclass(frozen=True)
class WarmupConfig:
    """The supervised warm-up before RL: teaches the answer format so RL has reward to work with
    (answer tokens only, on training prompts)."""

    iters: int = option(150, flag="--warmup-iters", help="supervised warm-up steps before RL (0: RL from the start)")
    lr: float = option(3e-3, flag="--warmup-lr", help="learning rate of the warm-up")
    min_lr: Optional[float] = option(None, flag="--warmup-min-lr",
                                     help="cosine-decay the warm-up's lr to this (default: constant)")

    def __post_init__(self):
        if self.iters < 0:
            raise UserError(f"--warmup-iters must be >= 0, got {self.iters}")
        if self.lr < 0:
            raise UserError(f"--warmup-lr must be >= 0, got {self.lr}")
        if self.min_lr is not None and not 0.0 <= self.min_lr <= self.lr:
            raise UserError(f"--warmup-min-lr must be between 0 and --warmup-lr ({self.lr}), got {self.min_lr}")


@dataclass(frozen=True)
class RunConfig:
    """What the run does around the steps: length, seed, batching, evaluation, logging."""

    train_iters: int = option(500, help="RL iterations (optimizer steps)")
    seed: int = option(1234, help="seeds the weights, projections, prompts and sampling")
    micro_batch_size: int = option(16, help="sequences per forward/backward")
    eval_prompts: int = option(150, help="held-out prompts (never trained on) for the greedy accuracy")
    exit_interval: int = option(0, help="stop (saving with --save) when the iteration is a multiple of this")
    output_dir: str = option("", help="metrics.jsonl, TensorBoard and summary.json (default: runs/<timestamp>)")
    tensorboard_dir: Optional[str] = option(None, help="default: <output-dir>/tensorboard")
    log_interval: int = option(1, help="without the progress bar: one line every N steps")
    progress: bool = option(True, flag="--no-progress", negative=True, help="no progress bar (logs, CI)")

    def __post_init__(self):
        _at_least(self, 1, "train_iters", "micro_batch_size", "eval_prompts", "log_interval")
        _at_least(self, 0, "exit_interval")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run, one section per component (see the module docstring)."""

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    logra: LogRAConfig = field(default_factory=LogRAConfig)
    kl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model_config: Optional[ModelConfig] = None
    """The resolved architecture (set by :func:`resolve`; None until then)."""

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
        if self.logra.master == "bf16-sr" and not self.model.bf16:
            raise UserError("--logra-master bf16-sr rounds into bf16 weights: it needs --bf16")
        if self.logra.zero1 != self.optimizer.distributed:
            object.__setattr__(self, "logra", dataclasses.replace(self.logra, zero1=self.optimizer.distributed))

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.model.bf16 else "fp32"


def resolve(config: TrainConfig, world_size: Optional[int] = None) -> TrainConfig:
    """The config with its model resolved once and checked against the layout (no process
    group needed). ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    if config.checkpoint.load is not None:
        model = load_model_config(config.checkpoint.load)  # a checkpoint decides its own architecture
    else:
        model = PRESETS[config.model.preset]
    tokenizer = build_run_tokenizer(config.model, config.checkpoint.load)
    if config.checkpoint.load is None and config.model.tokenizer_model is None and config.model.preset == "tiny":
        model = model.with_changes(vocab=tokenizer.vocab_size)  # the embedded default: no unused rows
    if tokenizer.vocab_size > model.vocab:
        raise UserError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {model.vocab}")
    if config.optimizer.kind == "logra":
        config.logra.check_model(model)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    layout = ParallelLayout(config.parallel.tensor_model_parallel_size,
                            config.parallel.pipeline_model_parallel_size, world_size)
    name = config.model.preset if config.checkpoint.load is None else config.checkpoint.load
    layout.check_model(model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab, name)
    if config.rollout.prompts_per_step % layout.data_parallel:
        raise UserError(f"--prompts-per-step {config.rollout.prompts_per_step} must be a multiple of the "
                        f"data-parallel size {layout.data_parallel}")
    return dataclasses.replace(config, model_config=model)
