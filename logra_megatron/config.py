"""The trainer's configuration: Megatron-style flags (and a YAML file whose keys mirror them)
turned into small, validated per-component configs before any process group starts.

``--config FILE.yaml`` supplies defaults; flags given on the command line override it. YAML keys
are the flag names without the leading dashes (``lr``, ``tensor-model-parallel-size`` or
``tensor_model_parallel_size``). Every value is validated here; a bad one is one clear line.
"""

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from logra_megatron.cli import ArgumentParser
from logra_megatron.errors import UserError
from logra_megatron.logra.config import LogRAConfig, parse_rank
from logra_megatron.training.config import KLControlConfig
from logra_megatron.models import ModelConfig, get_preset
from logra_megatron.training.config import OptimizerSettings


@dataclass(frozen=True)
class GRPOConfig:
    """Rollout and GRPO settings."""

    prompts_per_step: int = 16
    """Prompts per optimizer step (global batch is prompts x group size sequences)."""
    group_size: int = 8
    """G: sampled completions per prompt."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's std (False: Dr.GRPO-style mean-only)."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    """Weight of the KL-to-reference penalty (0: no reference model is kept)."""
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 6
    reward: str = "exact_match"
    """A registered reward function (logra_megatron.rl.rewards)."""
    max_operand: int = 19
    """The arithmetic task's largest operand."""
    held_out_fraction: float = 0.3
    """Share of the arithmetic problems held out for evaluation (never trained on)."""


@dataclass(frozen=True)
class RunConfig:
    """What the run does around the steps: warm-up, evaluation, logging, checkpoints."""

    train_iters: int = 500
    warmup_iters: int = 150
    """Supervised warm-up steps on training prompts before RL (0 = RL from the start)."""
    warmup_lr: float = 3e-3
    warmup_min_lr: Optional[float] = None
    """The warm-up's learning rate decays (cosine) from ``warmup_lr`` to this; None = constant."""
    eval_prompts: int = 150
    """Held-out prompts (never trained on) for the greedy accuracy before/after."""
    micro_batch_size: int = 16
    seed: int = 1234
    output_dir: str = ""
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: int = 0
    exit_interval: int = 0
    """Stop (saving to ``save`` if set) once the RL iteration count is a multiple of this; 0 = never."""
    tensorboard_dir: Optional[str] = None
    log_interval: int = 1
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    bf16: bool = False
    progress: bool = True


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    optimizer: OptimizerSettings
    logra: LogRAConfig
    kl: KLControlConfig
    grpo: GRPOConfig
    run: RunConfig
    preset: str = "tiny"
    extras: dict = field(default_factory=dict)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="logra_megatron.train",
                            description="GRPO post-training on Megatron-Core with LoGRA.")
    add = parser.add_argument
    add("--config", help="YAML file whose keys mirror these flags (flags override it)")
    group = parser.add_argument_group("model and parallelism")
    group.add_argument("--preset", default="tiny")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--seq-length", type=int, default=None, help="max prompt + completion tokens")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--tokenizer-type", default=None, help="SentencePieceTokenizer or HuggingFaceTokenizer")
    group.add_argument("--tokenizer-model", default=None)
    group = parser.add_argument_group("optimization")
    group.add_argument("--optimizer", choices=("adam", "logra"), default="logra")
    group.add_argument("--lr", type=float, default=3e-4)
    group.add_argument("--min-lr", type=float, default=0.0,
                       help="the RL lr decays (cosine) from --lr to this over --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--micro-batch-size", type=int, default=16)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="sequences per step (default: prompts-per-step x group-size)")
    group.add_argument("--train-iters", type=int, default=500)
    group.add_argument("--seed", type=int, default=1234)
    group = parser.add_argument_group("LoGRA")
    group.add_argument("--logra-rank", default="0.5")
    group.add_argument("--logra-refresh-interval", type=int, default=10)
    group.add_argument("--logra-oversampling", type=int, default=4)
    group.add_argument("--logra-second-moment", choices=("rotate", "reset"), default="rotate")
    group = parser.add_argument_group("predicted-KL control")
    group.add_argument("--kl-control", choices=("off", "probe", "linear"), default="probe")
    group.add_argument("--kl-target", type=float, default=0.01)
    group.add_argument("--kl-probe-sequences", type=int, default=8)
    group.add_argument("--kl-realized-interval", type=int, default=5)
    group = parser.add_argument_group("GRPO")
    group.add_argument("--prompts-per-step", type=int, default=16)
    group.add_argument("--group-size", type=int, default=8)
    group.add_argument("--no-std-normalization", action="store_true")
    group.add_argument("--clip-low", type=float, default=0.2)
    group.add_argument("--clip-high", type=float, default=0.28)
    group.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference penalty")
    group.add_argument("--kl-estimator", choices=("k1", "k2", "k3", "low_var_kl"), default="low_var_kl")
    group.add_argument("--entropy-coef", type=float, default=0.0)
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--max-new-tokens", type=int, default=6)
    group.add_argument("--reward", default="exact_match")
    group.add_argument("--max-operand", type=int, default=19, help="arithmetic task operand range 0..N")
    group.add_argument("--held-out-fraction", type=float, default=0.3,
                       help="share of arithmetic problems held out for evaluation")
    group = parser.add_argument_group("run")
    group.add_argument("--warmup-iters", type=int, default=150, help="supervised warm-up steps before RL")
    group.add_argument("--warmup-lr", type=float, default=3e-3)
    group.add_argument("--warmup-min-lr", type=float, default=None,
                       help="cosine-decay the warm-up's lr to this (default: constant)")
    group.add_argument("--eval-prompts", type=int, default=150)
    group.add_argument("--output-dir", default=None, help="default: runs/<timestamp>")
    group.add_argument("--save", default=None)
    group.add_argument("--load", default=None)
    group.add_argument("--save-interval", type=int, default=0)
    group.add_argument("--exit-interval", type=int, default=0,
                       help="stop (and save, with --save) when the iteration is a multiple of this")
    group.add_argument("--tensorboard-dir", default=None, help="default: <output-dir>/tensorboard")
    group.add_argument("--log-interval", type=int, default=1)
    group.add_argument("--no-progress", action="store_true")
    return parser


def _read_yaml(path: str, parser: ArgumentParser) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
    except yaml.YAMLError as error:
        raise UserError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UserError(f"config file {path} must be a mapping of flag names to values")
    known = {action.dest: action for action in parser._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest in ("help", "config"):
            raise UserError(f"config file {path}: unknown key {key!r}")
        action = known[dest]
        if action.choices is not None and value not in action.choices:
            raise UserError(f"config file {path}: {key} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
        if action.type is not None and value is not None:
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                raise UserError(f"config file {path}: {key} has an invalid value {value!r}") from None
        defaults[dest] = value
    return defaults


def parse_train_args(argv=None) -> TrainConfig:
    """Flags (+ optional YAML) -> validated :class:`TrainConfig`. Raises UserError/exits 2."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**_read_yaml(first.config, parser))
    args = parser.parse_args(argv)
    return config_from_args(args)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    positive = ("micro_batch_size", "train_iters", "prompts_per_step", "group_size", "max_new_tokens",
                "eval_prompts", "log_interval")
    for name in positive:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_iters", "save_interval", "exit_interval", "lr_warmup_iters"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if (args.tokenizer_type is None) != (args.tokenizer_model is None):
        raise UserError("--tokenizer-type and --tokenizer-model go together")
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise UserError(f"tokenizer model not found: {args.tokenizer_model}")
    if args.load is not None and not os.path.isdir(args.load):
        raise UserError(f"checkpoint directory not found: {args.load}")
    sequences = args.prompts_per_step * args.group_size
    if args.global_batch_size is not None and args.global_batch_size != sequences:
        raise UserError(f"--global-batch-size {args.global_batch_size} must equal --prompts-per-step x "
                        f"--group-size = {sequences}")
    if args.load is not None:
        from logra_megatron.checkpoint import load_model_config

        model = load_model_config(args.load)  # a checkpoint decides its own architecture
    else:
        model = get_preset(args.preset)
    logra = LogRAConfig(rank=parse_rank(args.logra_rank), refresh_interval=args.logra_refresh_interval,
                        oversampling=args.logra_oversampling, second_moment=args.logra_second_moment,
                        zero1=args.use_distributed_optimizer, seed=args.seed)
    if args.optimizer == "logra":
        logra.check_model(model)
    optimizer = OptimizerSettings(kind=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                                  clip_grad=args.clip_grad, distributed=args.use_distributed_optimizer)
    kl = KLControlConfig(mode=args.kl_control, target=args.kl_target,
                         probe_sequences=args.kl_probe_sequences,
                         realized_interval=args.kl_realized_interval)
    if args.max_operand < 1:
        raise UserError(f"--max-operand must be >= 1, got {args.max_operand}")
    if not 0.0 <= args.min_lr <= args.lr:
        raise UserError(f"--min-lr must be between 0 and --lr ({args.lr}), got {args.min_lr}")
    if not 0.0 < args.held_out_fraction < 1.0:
        raise UserError(f"--held-out-fraction must be strictly between 0 and 1, got {args.held_out_fraction}")
    if args.warmup_min_lr is not None and not 0.0 <= args.warmup_min_lr <= args.warmup_lr:
        raise UserError(f"--warmup-min-lr must be between 0 and --warmup-lr ({args.warmup_lr}), "
                        f"got {args.warmup_min_lr}")
    if args.temperature <= 0:
        raise UserError("--temperature must be > 0 for RL sampling")
    grpo = GRPOConfig(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                      normalize_std=not args.no_std_normalization, clip_low=args.clip_low,
                      clip_high=args.clip_high, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                      entropy_coef=args.entropy_coef, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, max_new_tokens=args.max_new_tokens, reward=args.reward,
                      max_operand=args.max_operand, held_out_fraction=args.held_out_fraction)
    from logra_megatron.rl.rewards import get_reward

    get_reward(grpo.reward)
    output_dir = args.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    run = RunConfig(train_iters=args.train_iters, warmup_iters=args.warmup_iters, warmup_lr=args.warmup_lr,
                    warmup_min_lr=args.warmup_min_lr, eval_prompts=args.eval_prompts, micro_batch_size=args.micro_batch_size,
                    seed=args.seed, output_dir=output_dir, save=args.save, load=args.load,
                    save_interval=args.save_interval, exit_interval=args.exit_interval,
                    tensorboard_dir=args.tensorboard_dir or os.path.join(output_dir, "tensorboard"),
                    log_interval=args.log_interval, tokenizer_type=args.tokenizer_type,
                    tokenizer_model=args.tokenizer_model,
                    tensor_model_parallel_size=args.tensor_model_parallel_size,
                    pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                    bf16=args.bf16, progress=not args.no_progress)
    from logra_megatron.parallel import ParallelLayout

    layout = ParallelLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                            int(os.environ.get("WORLD_SIZE", "1")))
    layout.check_model(model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab, args.preset)
    if grpo.prompts_per_step % layout.data_parallel:
        raise UserError(f"--prompts-per-step {grpo.prompts_per_step} must be a multiple of the "
                        f"data-parallel size {layout.data_parallel}")
    return TrainConfig(model=model, optimizer=optimizer, logra=logra, kl=kl, grpo=grpo, run=run,
                       preset=args.preset, extras={"min_lr": args.min_lr, "lr_warmup_iters": args.lr_warmup_iters,
                                                   "seq_length": args.seq_length})
