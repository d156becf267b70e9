"""The memory planner's flags (tools/plan_memory.py) and the :class:`PlanSettings` they give.

Megatron's and the trainer's flag names where they exist, so a job's command line carries over.
Defaults describe a plain run of the trainer (its LoGRA rank, master mode and KL control, its
packed microbatches), sequences of 2048 tokens, one sequence's worth of tokens per microbatch, 64
sequences per step and no rollout engine, unless the flags say otherwise.
"""

import json
from dataclasses import replace
from typing import Optional

from logra_megatron.engine_memory import KEEPS_ITS_OWN_WEIGHTS, SAMPLES_WITH_TRAINER_WEIGHTS, EngineMemory
from logra_megatron.errors import UserError
from logra_megatron.logra.config import MASTER_MODES, UPDATE_RULES, LogRAConfig, add_rank_arguments, rank_settings
from logra_megatron.models.config import ATTENTION_BACKENDS, PRESETS, ModelConfig, get_preset
from logra_megatron.ops.multiples import ceil_div
from logra_megatron.planning.settings import (MOMENT_DTYPES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, ROWS,
                                              PlanSettings, RolloutPlan, settings_for_row)
from logra_megatron.training.config import KL_MODES

GIB = 1024**3
OPTIMIZER_CHOICES = ROWS + ("both", "all")


def add_baseline_arguments(parser) -> None:
    """The dense baseline rows' own flags (Megatron's names), for the planner and
    tools/benchmark_optimizer.py alike."""
    parser.add_argument("--exp-avg-dtype", choices=tuple(MOMENT_DTYPES), default="bf16",
                        help="adam-precision-aware: dtype of Adam's first moment (default bf16)")
    parser.add_argument("--exp-avg-sq-dtype", choices=tuple(MOMENT_DTYPES), default="bf16",
                        help="adam-precision-aware: dtype of Adam's second moment (default bf16)")
    parser.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                        help="adam-cpu-offload: the fraction of the optimizer's parameters whose state "
                             "and masters live on the host (default 1.0)")


def add_arguments(parser, rollout_engines=None) -> None:
    """The planner's flags on an argparse parser (tools/plan_memory.py). ``rollout_engines``: the
    trainer's registry of rollout engines (rollout/engine.py, a layer above the planner, so the
    caller hands it down), declaring its ``--rollout-engine`` flag here."""
    model = parser.add_argument_group("model")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=tuple(PRESETS), help="a named model (logra_megatron/models/config.py)")
    source.add_argument("--model-config", metavar="FILE.json",
                        help="a model_config.json as a checkpoint holds it (logra_megatron/checkpoint.py)")

    layout = parser.add_argument_group("layout and GPUs")
    layout.add_argument("--tensor-model-parallel-size", type=int, default=1)
    layout.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    layout.add_argument("--data-parallel-size", type=int, default=None,
                        help="default: --gpus / (TP x PP), or 1 without --gpus")
    layout.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="Megatron's interleaved pipeline (PP > 1): each pipeline rank holds several model "
                             "chunks of this many layers, run by Megatron's interleaved schedule")
    layout.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                        help="Megatron's newer name for the same: this many model chunks per pipeline rank "
                             "(give one of the two)")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron's sequence parallelism (TP > 1): norms, residual stream and pipeline "
                             "messages split along the sequence over the TP ranks; with --search, applied to "
                             "every layout with TP > 1")
    layout.add_argument("--overlap-grad-reduce", action="store_true",
                        help="Megatron's: the DP reduction in buckets during the backward (dense gradients and "
                             "LoGRA's sketches); the bytes change only by each bucket's padding under "
                             "--use-distributed-optimizer")
    layout.add_argument("--overlap-param-gather", action="store_true",
                        help="Megatron's (with --use-distributed-optimizer and --overlap-grad-reduce): the "
                             "weights' all-gather ahead of the next forward, into the same buffer (no bytes change)")
    layout.add_argument("--ddp-bucket-size", type=int, default=None,
                        help="Megatron's: elements per gradient bucket with --overlap-grad-reduce "
                             "(default max(4e7, 1e6 x DP))")
    layout.add_argument("--gpus", type=int, default=None, help="GPUs of the job (with --search: the GPUs to fill)")
    layout.add_argument("--gpus-per-node", type=int, default=8,
                        help="--search keeps tensor parallelism within a node (default 8)")
    layout.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU in GiB: report whether each plan fits, and its headroom")
    layout.add_argument("--reserve-gib", type=float, default=2.0,
                        help="memory the plan does not model and a GPU still needs (CUDA context, NCCL "
                             "communicators, allocator fragmentation); default 2")
    layout.add_argument("--search", action="store_true",
                        help="try every TP x PP x DP layout of --gpus (TP within a node and dividing heads, kv "
                             "heads and FFN; PP dividing the layers) and pick, per optimizer, the one with the "
                             "most headroom")

    optimizer = parser.add_argument_group("optimizer and precision")
    optimizer.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="both",
                           help="the row to plan: adam (Megatron's dense Adam as users run it: no KL controller, "
                                "fp32 grads, masters and moments), adam-precision-aware (bf16 grads, 16-bit master "
                                "remainders, bf16/fp8 moments; distributed optimizer), adam-cpu-offload (optimizer "
                                "state and fp32 masters on the host), adam-8bit (block-wise 8-bit moments), adam-kl "
                                "(dense Adam under our KL controller), logra; both: adam and logra (default); all: "
                                "every row")
    add_baseline_arguments(optimizer)
    optimizer.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32",
                           help="adam-cpu-offload: the GPU gradient buffer's dtype (Megatron's main_grads_dtype "
                                "under --use-precision-aware-optimizer; default fp32)")
    optimizer.add_argument("--use-distributed-optimizer", action="store_true",
                           help="Megatron's distributed optimizer (dense) / LoGRA's ZeRO-1 state sharding")
    optimizer.add_argument("--bf16", action="store_true", help="bf16 weights (fp32 gradients and masters)")
    defaults = LogRAConfig()
    add_rank_arguments(optimizer)
    # A registered rule or outside code (package.module:Class), as the trainer takes it: the plan
    # counts what the rule declares of its memory (logra/update_rules.py), so any rule is planned.
    optimizer.add_argument("--logra-update", type=UPDATE_RULES.parse, default=defaults.update, metavar="RULE",
                           help=UPDATE_RULES.help("LoGRA's sketch-space update rule"))
    optimizer.add_argument("--logra-master", choices=MASTER_MODES, default=defaults.master)
    optimizer.add_argument("--logra-embeddings", action="store_true", help="sketch the embedding and output layer")
    optimizer.add_argument("--logra-norm-probes", type=int, default=defaults.norm_probes)
    optimizer.add_argument("--kl-control", choices=KL_MODES, default="probe",
                           help="the predicted-KL controller of the logra and adam-kl rows, as in the trainer "
                                "(default probe): its copies of the dense optimizer's fp32 mains are held during a "
                                "step; the dense baselines run without it")
    optimizer.add_argument("--kl-probe-sequences", type=int, default=8)

    batch = parser.add_argument_group("batch and activations")
    batch.add_argument("--micro-batch-size", type=int, default=1)
    batch.add_argument("--global-batch-size", type=int, default=64,
                       help="sequences per optimizer step over all DP replicas (default 64)")
    batch.add_argument("--seq-length", type=int, default=2048, help="tokens per training sequence (default 2048)")
    # The trainer's packing flags (rl/config.py RunConfig), with its meanings: packed by default.
    batch.add_argument("--no-pack-sequences", dest="pack_sequences", action="store_false",
                       help="plan padded microbatches (--micro-batch-size rows of --seq-length) instead of the "
                            "trainer's packed ones (rows end to end up to --max-tokens-per-microbatch, attention "
                            "per row; only with sdpa attention, as the trainer packs)")
    batch.add_argument("--max-tokens-per-microbatch", type=int, default=0,
                       help="packed: tokens per microbatch, which the activations follow; 0 (default): the "
                            "trainer's default, --micro-batch-size x --seq-length")
    batch.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="core attention, as the trainer's flag: sdpa (auto; no seq x seq scores in memory) "
                            "or unfused (Megatron's DotProductAttention: b x heads x seq x seq scores per layer)")
    batch.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default="none")
    batch.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None)
    batch.add_argument("--recompute-num-layers", type=int, default=None)

    rl = parser.add_argument_group("beside training")
    rl.add_argument("--reference-model", action="store_true",
                    help="a frozen reference policy for a KL penalty (weights in the run's dtype)")
    rl.add_argument("--rollout-sequences", type=int, default=0,
                    help="sequences a colocated rollout engine generates at once, over all DP replicas "
                         "(each replica holds its share's KV cache); default 0: no rollout engine")
    rl.add_argument("--rollout-max-tokens", type=int, default=None,
                    help="prompt + response tokens per rollout sequence (default: --seq-length)")
    if rollout_engines is not None:
        # The trainer's flag and registry (rl/config.py RolloutConfig.engine): a package engine or
        # package.module:Class, planned as its class declares its memory (engine_memory.py).
        rl.add_argument(rollout_engines.flag, type=rollout_engines.parse, default=None, metavar="ENGINE",
                        help=rollout_engines.help("the trainer's rollout engine, planned as it declares its memory")
                        + " (default: megatron, or what --rollout-engine-weights says)")
    rl.add_argument("--rollout-engine-weights", choices=("shared", "separate"), default=None,
                    help="without --rollout-engine: shared (default): the engine samples with the trainer's "
                         "weights (--rollout-engine megatron); separate: it keeps its own bf16 copy, sharded like "
                         "the trainer, and a KV cache of every sequence in flight; with --rollout-engine, it must "
                         "agree with the engine's declaration")


def load_model(args) -> ModelConfig:
    """The model the flags name (a preset, or a model_config.json)."""
    if args.model_config:
        try:
            with open(args.model_config) as handle:
                values = json.load(handle)
        except OSError as error:
            raise UserError(f"cannot read --model-config {args.model_config}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise UserError(f"--model-config {args.model_config} is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise UserError(f"--model-config {args.model_config} must hold a JSON object")
        return ModelConfig.from_dict(values)
    if args.preset:
        return get_preset(args.preset)
    raise UserError("give the model: --preset NAME or --model-config FILE.json")


def data_parallel_size(args) -> int:
    """``--data-parallel-size``, or what ``--gpus`` leaves after TP x PP, or 1."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise UserError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {args.gpus}")
        if args.gpus % (tp * pp):
            raise UserError(f"--gpus {args.gpus} is not divisible by TP {tp} x PP {pp}")
        dp = args.gpus // (tp * pp)
        if args.data_parallel_size is not None and args.data_parallel_size != dp:
            raise UserError(f"--data-parallel-size {args.data_parallel_size} does not match --gpus {args.gpus} "
                            f"/ (TP {tp} x PP {pp}) = {dp}")
        return dp
    dp = args.data_parallel_size or 1
    if dp < 1:
        raise UserError(f"--data-parallel-size must be >= 1, got {dp}")
    return dp


def rollout_for(args, data_parallel: int) -> RolloutPlan:
    """This DP replica's share of ``--rollout-sequences`` (rounded up) and their length."""
    if args.rollout_sequences < 0:
        raise UserError(f"--rollout-sequences must be >= 0, got {args.rollout_sequences}")
    tokens = args.rollout_max_tokens if args.rollout_max_tokens is not None else args.seq_length
    if tokens < 1:
        raise UserError(f"--rollout-max-tokens must be >= 1, got {tokens}")
    per_replica = ceil_div(args.rollout_sequences, data_parallel)
    return RolloutPlan(sequences_in_flight=per_replica, max_tokens=tokens if per_replica else 0,
                       dtype_bytes=2, engine=engine_of(args))


def engine_of(args) -> EngineMemory:
    """The rollout engine's memory declaration: ``args.rollout_engine_memory``, what the engine
    ``--rollout-engine`` names declares (resolved by tools/plan_memory.py), else the one
    ``--rollout-engine-weights`` stands for; the two flags must agree on the engine's own weights."""
    declared: Optional[EngineMemory] = getattr(args, "rollout_engine_memory", None)
    weights = getattr(args, "rollout_engine_weights", None)
    if declared is None:
        return KEEPS_ITS_OWN_WEIGHTS if weights == "separate" else SAMPLES_WITH_TRAINER_WEIGHTS
    if weights is not None and (weights == "separate") != declared.own_weights:
        holds = "keeps its own copy of the weights" if declared.own_weights else "samples with the trainer's weights"
        raise UserError(f"--rollout-engine-weights {weights} contradicts --rollout-engine {args.rollout_engine}, "
                        f"which {holds}; give one of the two")
    return declared


def settings_from_args(args, optimizer: Optional[str] = None) -> PlanSettings:
    """The :class:`PlanSettings` of the flags, for the row ``optimizer`` (settings.py ``ROWS``;
    default: the one ``--optimizer`` names, or logra for ``both`` and ``all``). The virtual
    pipeline flags come resolved as ``args.virtual_pipeline`` (chunks per rank): tools/plan_memory.py
    resolves them through the trainer's own ``ParallelConfig``, which sits above the planner."""
    model = load_model(args)
    dp = data_parallel_size(args)
    if optimizer is None:
        optimizer = "logra" if args.optimizer in ("both", "all") else args.optimizer
    logra = LogRAConfig(**rank_settings(args), update=args.logra_update, master=args.logra_master,
                        embeddings=args.logra_embeddings, norm_probes=args.logra_norm_probes,
                        zero1=args.use_distributed_optimizer)
    if args.kl_probe_sequences < 1:
        raise UserError(f"--kl-probe-sequences must be >= 1, got {args.kl_probe_sequences}")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise UserError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
                        "(as Megatron-LM's)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise UserError(f"--ddp-bucket-size must be >= 1, got {args.ddp_bucket_size}")
    base = PlanSettings(
        model=model, tensor_parallel=args.tensor_model_parallel_size,
        pipeline_parallel=args.pipeline_model_parallel_size, data_parallel=dp, optimizer="logra",
        virtual_pipeline=getattr(args, "virtual_pipeline", None),
        distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16, logra=logra,
        kl_control=args.kl_control, kl_probe_sequences=args.kl_probe_sequences,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        pack_sequences=args.pack_sequences, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        seq_length=args.seq_length, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        sequence_parallel=getattr(args, "sequence_parallel", False),
        overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
        attention_backend=args.attention_backend, reference_model=args.reference_model,
        rollout=rollout_for(args, dp), exp_avg_dtype=args.exp_avg_dtype, exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        optimizer_offload_fraction=args.optimizer_offload_fraction, main_grads_dtype=args.main_grads_dtype)
    return settings_for_row(base, optimizer)


def optimizers_of(args) -> tuple:
    """The rows ``--optimizer`` names (settings.py ``ROWS``)."""
    if args.optimizer == "both":
        return ("adam", "logra")
    return ROWS if args.optimizer == "all" else (args.optimizer,)


def with_optimizer(settings: PlanSettings, optimizer: str) -> PlanSettings:
    return replace(settings, optimizer=optimizer)
