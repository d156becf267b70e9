"""A training loop written the way Megatron-LM's ``pretrain_gpt.py`` and ``training.py`` are, with
LoGRA swapped in by two lines: the layer spec and the optimizer factory.

    torchrun --standalone --nproc-per-node 2 examples/megatron_loop.py --optimizer logra \\
        --tensor-model-parallel-size 2 --train-iters 20

A model provider, a ``get_model`` that builds one model chunk per virtual pipeline stage and
wraps each in Megatron's DDP, ``get_megatron_optimizer`` (or ``get_logra_optimizer``),
``OptimizerParamScheduler``, ``get_forward_backward_func``, ``dist_checkpointing`` save and load.
The data is the tiny preset's language-model task: 64 fixed random sequences, cycled, so the
loss falls as the model memorizes them. The last line printed is one JSON object.

Flags are Megatron-LM's, with its meanings. Only this file's ``--optimizer`` lines differ
between dense Adam and LoGRA (look for ``LOGRA``).
"""

import contextlib
import dataclasses
import json
import os
import sys
from functools import partial

import torch

from logra_megatron import parallel
from logra_megatron.checkpoint_args import CHECKPOINT_VERSION, common_state_strategy, megatron_lm_args
from logra_megatron.errors import UserError, exit_on_user_error
from logra_megatron.layout import ParallelLayout
from logra_megatron.models import get_preset
from logra_megatron.models.build import build_gpt_model, causal_attention_mask, gpt_layer_spec, transformer_config
from logra_megatron.models.weights import initialize_layout_independent
from logra_megatron.platform.phases import PhaseTimer, phase


def build_parser():
    from logra_megatron.cli import ArgumentParser
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.rl.config import CheckpointConfig, ModelSourceConfig, ParallelConfig, RolloutConfig, RunConfig
    from logra_megatron.schema import add_flags
    from logra_megatron.training.config import LRScheduleConfig, OptimizerSettings

    # Megatron-LM's flags, declared by the package's config schema (logra_megatron/schema.py): the
    # trainer's names, meanings and help. The defaults that differ from the trainer's are this
    # example's: a run of seconds on a CPU that memorizes 64 random sequences from random weights
    # (a pretraining-like lr, Megatron's 0.01 weight decay), where the trainer fine-tunes a policy.
    parser = ArgumentParser(prog="megatron_loop", description=__doc__.split("\n\n")[0])
    add_flags(parser, OptimizerSettings, "kind", "lr", "weight_decay", "clip_grad", "distributed",
              defaults={"lr": 3e-3, "weight_decay": 0.01})
    # One fixed rank at every layout and preset (docs/SCALING.md's overlap figures are at rank 16).
    add_flags(parser, LogRAConfig, "rank", defaults={"rank": 16})
    add_flags(parser, ModelSourceConfig, "preset", "bf16")
    parser.add_argument("--num-layers", type=int, default=None, help="transformer layers (default: the preset's)")
    add_flags(parser, ParallelConfig, "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "overlap_grad_reduce", "overlap_param_gather", "sequence_parallel", "num_layers_per_virtual_pipeline_stage")
    parser.add_argument("--ddp-bucket-size", type=int, default=None,
                        help="elements per gradient bucket (Megatron's; LoGRA's sketch buckets too)")
    add_flags(parser, RunConfig, "micro_batch_size", "train_iters", "seed", "exit_interval",
              defaults={"micro_batch_size": 2, "train_iters": 20})
    add_flags(parser, RolloutConfig, "global_batch_size", "seq_length", defaults={"global_batch_size": 8, "seq_length": 32},
              notes={"global_batch_size": "8 sequences per step", "seq_length": "32 tokens per sequence"})
    add_flags(parser, LRScheduleConfig, "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters",
              "lr_wsd_decay_style", "lr_wsd_decay_iters", defaults={"min_lr": 3e-4, "lr_warmup_iters": 2})
    add_flags(parser, CheckpointConfig, "save", "save_interval", "load")
    return parser


def parse_args(argv):
    from logra_megatron.schema import validate_flags
    from logra_megatron.training.config import LRScheduleConfig

    parser = build_parser()
    args = parser.parse_args(argv)
    validate_flags(parser, args)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = get_preset(args.preset)
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise UserError(f"--num-layers must be >= 1, got {args.num_layers}")
        model = dataclasses.replace(model, layers=args.num_layers)
    layout = ParallelLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size)
    layout.check_model(model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab, args.preset)
    args.virtual_pipeline = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = model.layers // args.pipeline_model_parallel_size
        if args.pipeline_model_parallel_size < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise UserError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
                            f"and must divide the {per_stage} layers of a pipeline stage")
        args.virtual_pipeline = per_stage // args.num_layers_per_virtual_pipeline_stage
    decay_iters = args.lr_decay_iters or args.train_iters  # Megatron's default: --train-iters
    if args.train_iters > 0 and args.lr_warmup_iters >= decay_iters:
        over = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        raise UserError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < {over} ({decay_iters})")
    LRScheduleConfig(lr_decay_style=args.lr_decay_style, lr_decay_iters=args.lr_decay_iters,
                     lr_wsd_decay_iters=args.lr_wsd_decay_iters,
                     lr_warmup_iters=args.lr_warmup_iters).check_iters(args.train_iters)
    per_step = args.micro_batch_size * layout.data_parallel
    if args.global_batch_size % per_step:
        raise UserError(f"--global-batch-size must be a multiple of micro batch x data-parallel = {per_step}")
    args.model, args.layout = model, layout
    return args


# --- pretrain_gpt.py ------------------------------------------------------------------------------

def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    from logra_megatron.logra import logra_layer_spec

    config = transformer_config(args.model, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                sequence_parallel=args.sequence_parallel, virtual_pipeline=args.virtual_pipeline)
    # LOGRA (1 of 2): the sketching linears in the layer spec.
    layer_spec = logra_layer_spec() if args.optimizer == "logra" else gpt_layer_spec()
    model = build_gpt_model(args.model, config, layer_spec, pre_process, post_process, vp_stage=vp_stage)
    initialize_layout_independent(model, args.model.vocab, args.seed)  # the same weights at any layout
    return model


def loss_func(loss_mask, output_tensor):
    """Mean next-token loss of a microbatch (Megatron's 2-tuple contract)."""
    losses = output_tensor.float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, attention_mask):
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output_tensor = model(tokens, positions, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, torch.ones_like(labels, dtype=torch.float))


# --- training.py --------------------------------------------------------------------------------------

def get_model(args):
    """One model chunk per virtual pipeline stage, each in Megatron's DDP (training.py's get_model)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    chunks = []
    stages = args.virtual_pipeline or 1
    for stage in range(stages):
        vp_stage = stage if args.virtual_pipeline else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        chunks.append(model_provider(args, pre, post, vp_stage))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce, bucket_size=args.ddp_bucket_size,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer)
    return [DistributedDataParallel(chunk.config, ddp_config, chunk,
                                    disable_bucketing=(index > 0)) for index, chunk in enumerate(chunks)]


def get_optimizer(args, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             clip_grad=args.clip_grad, bf16=args.bf16,
                             use_distributed_optimizer=args.use_distributed_optimizer,
                             overlap_param_gather=args.overlap_param_gather)
    if args.optimizer == "logra":
        # LOGRA (2 of 2): the optimizer factory.
        from logra_megatron import get_logra_optimizer
        from logra_megatron.logra import LogRAConfig

        return get_logra_optimizer(config, model, LogRAConfig(rank=args.logra_rank, seed=args.seed))
    return get_megatron_optimizer(config, model)


def get_scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # Steps count samples, as Megatron-LM's training.py counts them (iterations x global batch).
    decay_iters = args.lr_decay_iters or args.train_iters
    wsd_iters = args.lr_wsd_decay_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant", wsd_decay_steps=wsd_iters * args.global_batch_size if wsd_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def wire_overlap(args, model):
    """What Megatron-LM's training.py sets on the model config for the schedules."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].module.config if hasattr(model[0], "module") else model[0].config
    if args.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
    if args.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    return config


def train_step(args, model, optimizer, scheduler, batches, config):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    mask = causal_attention_mask(args.seq_length, device=batches[0][0].device)
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, attention_mask=mask), data_iterator=[iter(batches) for _ in model]
        if len(model) > 1 else iter(batches), model=model, num_microbatches=len(batches),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
    # With --overlap-grad-reduce, LoGRA's sketch buckets whose all-reduce the backward started.
    overlap = getattr(getattr(optimizer, "sketch_buffer", None), "overlap", None)
    args.buckets_started_in_backward = (overlap.started, len(overlap.buckets)) if overlap is not None else None
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    loss = float(sum(item["lm loss"] for item in losses) / len(losses)) if losses else 0.0
    return parallel.agree_on_scalar(loss), grad_norm


def sharded_state(args, model, optimizer, scheduler, iteration, is_loading=False):
    # As Megatron-LM's checkpointing does: the model's own state (through ``.module``, not the DDP
    # wrapper's, whose keys would carry a ``module.`` prefix no other tool expects), one
    # ``model<i>`` entry per virtual-pipeline chunk, and the run's ``args`` with Megatron-LM's
    # names (what its --use-checkpoint-args and our trainer's --load read the model from).
    state = {"iteration": iteration, "scheduler": scheduler.state_dict() if scheduler else None,
             "checkpoint_version": CHECKPOINT_VERSION,
             "args": megatron_lm_args(args.model, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                      virtual_pipeline=args.virtual_pipeline, iteration=iteration, bf16=args.bf16,
                                      seq_length=args.seq_length)}
    if len(model) == 1:
        state["model"] = model[0].module.sharded_state_dict()
    else:
        for index, chunk in enumerate(model):
            state[f"model{index}"] = chunk.module.sharded_state_dict()
    model_state = {k: v for k, v in state.items() if k.startswith("model")}
    state["optimizer"] = optimizer.sharded_state_dict(model_state if len(model) > 1 else state["model"],
                                                      is_loading=is_loading)
    return state


def save_checkpoint(args, model, optimizer, scheduler, iteration):
    from megatron.core import dist_checkpointing

    directory = os.path.join(args.save, f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(sharded_state(args, model, optimizer, scheduler, iteration), directory)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(iteration))
    torch.distributed.barrier()


def load_checkpoint(args, model, optimizer, scheduler) -> int:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    tracker = os.path.join(args.load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        raise UserError(f"--load {args.load}: no latest_checkpointed_iteration.txt")
    iteration = int(open(tracker).read().strip())
    directory = os.path.join(args.load, f"iter_{iteration:07d}")
    try:
        # Megatron-LM's args are a pickled namespace, which dist_checkpointing's own common-state
        # reader (weights_only) refuses: ours reads it as Megatron-LM's loader does.
        loaded = dist_checkpointing.load(sharded_state(args, model, optimizer, None, iteration, is_loading=True),
                                         directory, common_strategy=common_state_strategy())
        for index, chunk in enumerate(model):
            chunk.module.load_state_dict(loaded["model"] if len(model) == 1 else loaded[f"model{index}"])
        optimizer.load_state_dict(loaded["optimizer"])
    except (RuntimeError, KeyError, ValueError, CheckpointException) as error:
        # A checkpoint of another model or optimizer (torch.distributed.checkpoint reports a
        # missing key as a CheckpointException, a BaseException, with the rank's error inside).
        cause = next(iter(error.failures.values()), error) if isinstance(error, CheckpointException) else error
        cause = getattr(cause, "exc", cause)  # a rank's failure arrives wrapped with its traceback
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"--load {directory}: {first_line[:300]}") from error
    if loaded.get("scheduler"):
        scheduler.load_state_dict(loaded["scheduler"])
    return iteration


def data(args, device):
    """This DP replica's microbatches of one step: (tokens, labels) pairs from 64 fixed sequences.
    Drawn on the CPU on purpose (the same ids on every device kind), then moved once."""
    generator = torch.Generator().manual_seed(args.seed)
    corpus = torch.randint(0, args.model.vocab, (64, args.seq_length + 1), generator=generator)
    per_replica = args.global_batch_size // args.layout.data_parallel
    step = 0
    while True:
        rows = torch.arange(step * args.global_batch_size, (step + 1) * args.global_batch_size) % len(corpus)
        mine = corpus[rows][parallel.dp_rank() * per_replica:(parallel.dp_rank() + 1) * per_replica].to(device)
        yield [(mine[i:i + args.micro_batch_size, :-1], mine[i:i + args.micro_batch_size, 1:])
               for i in range(0, per_replica, args.micro_batch_size)]
        step += 1


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel.init_distributed()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)

    model = get_model(args)
    optimizer = get_optimizer(args, model)
    scheduler = get_scheduler(args, optimizer)
    config = wire_overlap(args, model)
    iteration = load_checkpoint(args, model, optimizer, scheduler) if args.load else 0

    device = next(model[0].parameters()).device
    batches = data(args, device)
    for _ in range(iteration):
        next(batches)
    losses = []
    rank0 = torch.distributed.get_rank() == 0
    # Wall time of every step after the first (warm-up), and of its exposed sketch reduction: the
    # optimizer's "sketch_reduce" phase, what the backward did not hide (platform/phases.py).
    timer, timed_steps, first = PhaseTimer(device), 0, iteration
    while iteration < args.train_iters:
        timed = iteration > first
        with timer if timed else contextlib.nullcontext(), phase("step") if timed else contextlib.nullcontext():
            loss, grad_norm = train_step(args, model, optimizer, scheduler, next(batches), config)
        timed_steps += timed
        iteration += 1
        losses.append(loss)
        if rank0:
            print(f"iteration {iteration}/{args.train_iters} lm loss {loss:.6f} grad norm {grad_norm:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.3e}", flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, model, optimizer, scheduler, iteration)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save_checkpoint(args, model, optimizer, scheduler, iteration)

    from megatron.core.optimizer import MegatronOptimizer

    if rank0:
        print(json.dumps({"optimizer": type(optimizer).__name__,
                          "megatron_optimizer": isinstance(optimizer, MegatronOptimizer),
                          "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                          "iterations": iteration, "losses": losses,
                          "sketch_buckets_started_in_backward": getattr(args, "buckets_started_in_backward", None),
                          "timed_steps": timed_steps,
                          "step_s": timer.seconds.get("step", 0.0) / max(timed_steps, 1),
                          "sketch_reduce_s": timer.seconds.get("sketch_reduce", 0.0) / max(timed_steps, 1)}),
              flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
