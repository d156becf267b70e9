"""Smoke job: build a preset, run forward/backward through Megatron's pipeline schedule and a few
optimizer steps (Megatron's dense Adam, or LoGRA) with Megatron's DDP, print each step's loss.

    torchrun --nproc-per-node 2 -m logra_megatron.smoke --tensor-model-parallel-size 2

It proves an install end to end on CPU or GPU; the RL trainer is the main job.
"""

import os
import sys
import time

import torch

from logra_megatron.checkpoint import check_checkpoint_dir, load_model_config
from logra_megatron.checkpoint_layout import select_checkpoint
from logra_megatron.cli import ArgumentParser
from logra_megatron.errors import UserError, exit_on_user_error
from logra_megatron.layout import ParallelLayout
from logra_megatron.logra.config import LogRAConfig, add_rank_arguments, rank_settings
from logra_megatron.models.config import get_preset
from logra_megatron.training.config import OptimizerSettings


def parse_args(argv=None):
    from logra_megatron import schema
    from logra_megatron.rl.config import ModelSourceConfig, parse_ckpt_format, parse_transformer_impl

    parser = ArgumentParser(prog="logra_megatron.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model preset name (default: tiny)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--train-iters", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--load", default=None, help="checkpoint directory to start from")
    parser.add_argument("--optimizer", choices=("adam", "logra"), default="adam",
                        help="Megatron dense Adam, or LoGRA sketch-space Adam")
    add_rank_arguments(parser)
    schema.add_flags(parser, LogRAConfig, "refresh_interval")
    schema.add_flags(parser, ModelSourceConfig, "attention_backend")
    parser.add_argument("--report-json", default=None, metavar="PATH",
                        help="after --train-iters steps, measure one more on every rank (training "
                             "state by component, peak step bytes, bytes passed to each collective "
                             "by TP/PP/DP group) and write all ranks' figures to PATH (rank 0 writes)")
    from logra_megatron.training.config import RecomputeConfig

    # Megatron's flags a Megatron command line passes, with the trainer's rules (docs/MEGATRON_FLAGS.md).
    parser.add_argument("--transformer-impl", type=parse_transformer_impl, default="local",
                        help="local (Megatron-Core's own layers; transformer_engine is not supported yet)")
    parser.add_argument("--ckpt-format", type=parse_ckpt_format, default="torch_dist",
                        help="format of --load: torch_dist (Megatron-Core dist_checkpointing), the only one")
    parser.add_argument("--fp16", action="store_true", help="refused: no loss scaling (the smoke job runs fp32)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron's sequence parallelism (TP > 1): norms and residuals split along the sequence")
    parser.add_argument("--overlap-grad-reduce", action="store_true",
                        help="Megatron's: the DP reduction in buckets during the backward (dense gradients and "
                             "LoGRA's sketches alike)")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="Megatron's ZeRO-1: optimizer state (and LoGRA's sketch state) sharded over DP")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="Megatron's (with --use-distributed-optimizer and --overlap-grad-reduce): the "
                             "updated dense weights all-gathered bucket by bucket ahead of the next forward; "
                             "sketched weights are updated in place on every rank, never gathered")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="Megatron's interleaved pipeline: layers per model chunk (several chunks per "
                             "pipeline rank; PP > 1)")
    parser.add_argument("--context-parallel-size", type=int, default=1, help="refused above 1 (not supported)")

    schema.add_arguments(parser, "recompute", RecomputeConfig, "activation recomputation")
    args = parser.parse_args(argv)
    args.recompute = RecomputeConfig(**schema.values_for(args, "recompute", RecomputeConfig))
    if args.fp16:
        parser.error("--fp16 is not supported: fp16 training needs loss scaling, which is not implemented")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        parser.error("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
                     "(as Megatron-LM's)")
    if args.num_layers_per_virtual_pipeline_stage is not None and (args.load or args.report_json):
        parser.error("--num-layers-per-virtual-pipeline-stage runs without --load and --report-json "
                     "(they read one model chunk per rank)")
    if args.context_parallel_size != 1:
        parser.error("--context-parallel-size > 1 is not supported: the sketching linears and the SDPA core "
                     "attention have no context-parallel path (ring attention, the sequence split over CP)")
    for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def validate(args, world_size: int):
    """Everything that can be checked before a process group starts."""
    if args.load:
        # A --save root (ours or Megatron-LM's: its newest complete iteration) or one checkpoint.
        chosen = select_checkpoint(args.load) if os.path.isdir(args.load) else None
        if chosen is None:
            check_checkpoint_dir(args.load)  # says what is missing
        args.load = chosen[1]
        model_config = load_model_config(args.load)
    else:
        model_config = get_preset(args.preset)
    layout = ParallelLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, world_size)
    layout.check_model(model_config.layers, model_config.heads, model_config.kv_heads,
                       model_config.ffn_hidden, model_config.vocab, args.preset)
    per_step = args.micro_batch_size * layout.data_parallel
    if args.global_batch_size % per_step != 0:
        raise UserError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of micro batch "
            f"size x data-parallel size = {per_step}"
        )
    if args.sequence_parallel and (layout.tensor_parallel < 2 or args.seq_length % layout.tensor_parallel):
        raise UserError(f"--sequence-parallel needs --tensor-model-parallel-size > 1 and a --seq-length "
                        f"({args.seq_length}) it divides")
    args.virtual_pipeline = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = model_config.layers // layout.pipeline_parallel
        chunk = args.num_layers_per_virtual_pipeline_stage
        if layout.pipeline_parallel < 2 or chunk < 1 or per_stage % chunk:
            raise UserError(f"--num-layers-per-virtual-pipeline-stage {chunk} needs --pipeline-model-parallel-size "
                            f"> 1 and must divide the {per_stage} layers of a pipeline stage")
        args.virtual_pipeline = per_stage // chunk
    if args.seq_length + 1 > model_config.max_seq:
        raise UserError(f"--seq-length {args.seq_length} exceeds the model's max_seq {model_config.max_seq}")
    logra_config = LogRAConfig(**rank_settings(args), refresh_interval=args.logra_refresh_interval)
    if args.optimizer == "logra":
        logra_config.check_model(model_config)
    return model_config, layout, logra_config


def run(args) -> list:
    # megatron-core (~5 s to import) loads only after the flags were checked.
    from logra_megatron import parallel
    from logra_megatron.checkpoint import load_checkpoint
    from logra_megatron.models.build import model_device
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable, train_step

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model_config, layout, logra_config = validate(args, world_size)
    parallel.initialize(layout.tensor_parallel, layout.pipeline_parallel, seed=args.seed,
                        virtual_pipeline=args.virtual_pipeline)
    bare_model, model, optimizer = build_trainable(
        model_config, OptimizerSettings(kind=args.optimizer, lr=args.lr, distributed=args.use_distributed_optimizer),
        logra_config, seed=args.seed, recompute=args.recompute, attention_backend=args.attention_backend,
        sequence_parallel=args.sequence_parallel, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather)
    if args.load:
        load_checkpoint(args.load, bare_model)

    # The same synthetic batch on every rank; each DP replica takes its own slice. Drawn on the
    # CPU on purpose: the token ids are then the same on every device kind (CPU runs and GPU runs
    # train on one batch); the slice moves to the model's device once.
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_config.vocab, (args.global_batch_size, args.seq_length + 1),
                           generator=generator)
    per_replica = args.global_batch_size // layout.data_parallel
    mine = tokens[parallel.dp_rank() * per_replica : (parallel.dp_rank() + 1) * per_replica].to(model_device(model[0] if isinstance(model, list) else model))

    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        print(f"smoke: preset={args.preset} params={model_config.num_parameters():,} "
              f"tp={layout.tensor_parallel} pp={layout.pipeline_parallel} dp={layout.data_parallel} "
              f"{f'vpp={args.virtual_pipeline} ' if args.virtual_pipeline else ''}optimizer={args.optimizer}",
              flush=True)
    def one_step():
        return train_step(model, optimizer, lambda m: lm_forward_backward(m, mine, args.micro_batch_size))

    losses, seconds = [], []
    for step in range(args.train_iters):
        start = time.perf_counter()
        loss, grad_norm = one_step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if rank0:
            print(f"step {step + 1}/{args.train_iters} loss {loss:.6f} grad_norm {grad_norm:.4f} "
                  f"time {seconds[-1]:.2f}s", flush=True)
    if args.report_json:
        losses.append(write_report(args, layout, bare_model, model, optimizer, one_step, seconds))
    return losses


def write_report(args, layout, bare_model, model, optimizer, one_step, seconds) -> float:
    """One more step, measured on every rank (:mod:`logra_megatron.training.measure`); rank 0
    writes every rank's figures to ``args.report_json``. Returns the measured step's loss."""
    import json
    import statistics

    from logra_megatron.training.measure import measure_components, measure_step, rank_coordinates

    coordinates = rank_coordinates()
    (loss, _), figures = measure_step(one_step, coordinates)
    components = measure_components(bare_model, model, optimizer)
    mine = {
        "rank": torch.distributed.get_rank(), **coordinates[torch.distributed.get_rank()],
        **components, "training_state_bytes": sum(components.values()),
        # the first step creates Adam's state: a warm-up, not timed unless it is the only one
        "step_time_s": statistics.median(seconds[1:] or seconds),
        **figures, "final_loss": loss,
    }
    everyone = [None] * torch.distributed.get_world_size() if mine["rank"] == 0 else None
    torch.distributed.gather_object(mine, everyone, dst=0)
    if mine["rank"] == 0:
        report = {"preset": args.preset, "optimizer": args.optimizer, "logra_rank": args.logra_rank,
                  "world_size": torch.distributed.get_world_size(), "tp": layout.tensor_parallel,
                  "pp": layout.pipeline_parallel, "dp": layout.data_parallel,
                  "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
                  "seq_length": args.seq_length, "timed_steps": max(len(seconds) - 1, 1),
                  "measured_step": len(seconds) + 1, "ranks": everyone}
        path = os.path.abspath(args.report_json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".partial", "w") as handle:
            json.dump(report, handle, indent=1)
        os.replace(path + ".partial", path)
        print(f"measured step {len(seconds) + 1} loss {loss:.6f}; per-rank report: {path}", flush=True)
    return loss


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    from logra_megatron import parallel

    try:
        losses = run(args)
        if torch.distributed.get_rank() == 0:
            print(f"smoke: ok, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
