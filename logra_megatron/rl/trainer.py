"""The GRPO trainer: :func:`train` reads top to bottom, calling one named phase after another.

    build (process groups, tokenizer, tasks, model + optimizer, rollout engine, controller)
    evaluate (initial) -> supervised warm-up (optional) -> evaluate (start of RL)
    for each step:
        prompts -> rollouts (engine) -> rewards -> group advantages
        -> old log-probs (and reference log-probs) -> policy loss through the pipeline schedule
        -> optimizer step under predicted-KL control -> engine weight sync -> log -> save
    evaluate (after RL) -> summary.json

Every rank runs the same code; data-parallel replicas take their own share of the prompts.
docs/ARCHITECTURE.md walks through one RL step.
"""

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from logra_megatron import parallel
from logra_megatron.checkpoint_args import megatron_lm_args
from logra_megatron.checkpoint_layout import iteration_dir
from logra_megatron.errors import UserError
from logra_megatron.faults import kill_point, nan_point
from logra_megatron.logra.accounting import state_bytes
from logra_megatron.models import build_gpt_model, gpt_layer_spec, transformer_config
from logra_megatron.models.build import unwrap_model
from logra_megatron.models.config import resolve_attention_backend
from logra_megatron.ops.multiples import round_up
from logra_megatron.rl.advantages import group_advantages
from logra_megatron.rl.balancing import balance_batch
from logra_megatron.rl.checkpointing import (check_shared_checkpoints, load_training_state, optimizer_compatibility,
                                             save_training_state)
from logra_megatron.rl.config import TrainConfig, lr_phases_line, resolve, run_inputs, widened_heads_line
from logra_megatron.rl.grpo import (policy_loss_backward, probe_and_held_out, sequence_logprobs, sequence_multiple,
                                     widen_to_multiple)
from logra_megatron.rl.evaluation import EvalResult, evaluate_records
from logra_megatron.rl.memory_plan import plan_line, plan_summary
from logra_megatron.rl.metrics import MetricsLogger
from logra_megatron.rl.minibatches import combine_steps, kept_rows, select_rows, split_minibatches, tied_groups
from logra_megatron.rl.reward_runner import RewardRunner
from logra_megatron.rl.rewards import get_reward
from logra_megatron.tokenizer import HUGGINGFACE_TYPES
from logra_megatron.rl.preemption import ExitSignalHandler
from logra_megatron.rl.prompt_format import PromptFormat
from logra_megatron.rl.tasks import TaskSource
from logra_megatron.rl.tokenizers import run_tokenizer_files
from logra_megatron.rollout.engine import build_rollout_engine
from logra_megatron.training.kl_control import PredictedKLController
from logra_megatron.training.lm import lm_forward_backward, model_chunks
from logra_megatron.training.lr_schedule import build_scheduler
from logra_megatron.training.setup import build_trainable, gather_updated_weights, train_step

# Sampling seeds: a function of (run seed, step, data-parallel rank), distinct for each, so a
# resumed run draws what the uninterrupted one drew and replicas draw different samples.
SAMPLING_SEED_PER_RUN = 1_000_003
SAMPLING_SEED_PER_STEP = 1009
EVAL_SAMPLING_SEED = 999_983
"""Sampled evaluation (``--eval-samples``) draws from seed ``run seed * SAMPLING_SEED_PER_RUN +
this``: a stream of its own, the same at the start and the end of training."""
SKIPPED_STEP = {"success": False, "grad_norm": None, "kl_pred": None, "step_scale": 0.0, "kl_realized": None,
                "controller_time_s": 0.0, "controller_extra_bytes": 0}
WARMUP_PROMPT_STREAM = 100_000
"""Warm-up batches are drawn as task steps ``WARMUP_PROMPT_STREAM + i``: a prompt stream apart
from the RL steps' ``0 .. train_iters - 1``."""
SEQ_LENGTH_MARGIN = 4
"""Warm-up rows hold ``prompt + answer + EOS``; the answer may be a few tokens longer than the
completions RL samples."""


@dataclass
class TrainerState:
    """What a checkpoint carries besides model and optimizer (rl/checkpointing.py)."""

    step: int = 0
    warmup_done: bool = False
    summary: dict = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    skipped_steps: int = 0
    """RL steps skipped for a non-finite loss, gradient, sketch or KL forecast (nothing committed)."""
    consecutive_skips: int = 0

    @classmethod
    def from_checkpoint(cls, state: dict) -> "TrainerState":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in state.items() if key in known})


@dataclass
class Run:
    """Everything :func:`build` makes; the phases below read it."""

    config: TrainConfig
    tokenizer: object
    tasks: TaskSource
    prompt_format: PromptFormat
    model: object
    """This rank's model, or under a virtual pipeline the list of its chunks (as ``ddp``)."""
    ddp: object
    optimizer: object
    engine: object
    controller: PredictedKLController
    logger: MetricsLogger
    reward: RewardRunner
    held_out: list
    state: TrainerState
    start_time: float
    reference: Optional[object] = None

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab_size


def train(config: TrainConfig) -> dict:
    """Run the whole job; returns the summary (with ``summary_path`` on the logging rank). From
    the start, ``--exit-signal`` (SIGTERM, SIGUSR1) no longer ends the process at once: the RL
    step in flight finishes, the run saves and returns (rl/preemption.py)."""
    with ExitSignalHandler(config.run.exit_signal.split(","), enabled=config.run.exit_signal_handler) as handler:
        return run_phases(config, handler)


def run_phases(config: TrainConfig, exit_handler: ExitSignalHandler) -> dict:
    """The phases of :func:`train`, one after another; at each RL step boundary every rank asks
    ``exit_handler`` whether a signal came (the same answer everywhere)."""
    run = build(config)
    config = run.config  # resolved: the warm-up's length, the prompts per step
    summary = run.state.summary
    run.logger.info(lr_phases_line(config))
    summary["memory_plan_bytes"] = plan_summary(run.config, torch.distributed.get_world_size(), rollout_length(run))
    run.logger.info(plan_line(summary["memory_plan_bytes"]))
    widened = widened_heads_line(run.config)
    if widened:
        run.logger.info(widened)
    if "held_out_accuracy_initial" not in summary:
        record_accuracy(run, "held_out_accuracy_initial", "initial")
    if not run.state.warmup_done:
        supervised_warmup(run)
        run.state.warmup_done = True
        run.optimizer.reset_state()  # RL starts from clean moments (docs/ARCHITECTURE.md)
        summary["warmup_iters"] = config.warmup.iters
        if config.warmup.iters:
            record_accuracy(run, "held_out_accuracy_before", "start of RL")
        else:  # no warm-up: the weights are the initial ones, and so is their accuracy
            summary["held_out_accuracy_before"] = summary["held_out_accuracy_initial"]
            summary["evaluation_before"] = summary["evaluation_initial"]
    scheduler = rl_scheduler(run)
    if config.loss.kl_coef > 0:
        run.reference = frozen_reference(run)
    saved_step = None
    for step in range(run.state.step, config.run.train_iters):
        if exit_handler.stop_requested():  # (a signal during the warm-up, or the step before)
            break
        run.controller.set_iteration(step)  # the KL budget's place on --kl-target-schedule
        kill_point("rl:step")  # (fault-injection tests only)
        metrics = rl_step(run, step)
        if not metrics["skipped"]:
            scheduler.step(1)  # as Megatron: a skipped iteration does not advance the schedule
        run.logger.step(step, metrics)
        run.state.step = step + 1
        count_skips(run, bool(metrics["skipped"]))
        if config.checkpoint.save and config.checkpoint.save_interval \
                and run.state.step % config.checkpoint.save_interval == 0:
            save(run)
            saved_step = run.state.step
        if should_exit(run):
            break
    preempted = exit_handler.stop_requested()
    finished = run.state.step >= config.run.train_iters and not preempted
    if finished and config.run.train_iters == 0:  # the warm-up alone: no RL, so its end is the start of RL
        summary["held_out_accuracy_after"] = summary["held_out_accuracy_before"]
        summary["evaluation_after"] = summary["evaluation_before"]
    elif finished:
        record_accuracy(run, "held_out_accuracy_after", "after RL")
    if config.checkpoint.save and saved_step != run.state.step:
        save(run)
    if preempted:
        summary["preempted_by"] = preempted
        run.logger.info(preemption_line(run, preempted))
    return write_summary(run, finished)


# --- phases ------------------------------------------------------------------------------------

def build(config: TrainConfig) -> Run:
    """Process groups, model + optimizer, engine, controller, logger; the state of a resumed run;
    the tokenizer, tasks and prompt format that ``resolve`` built (``config.inputs``)."""
    config = config if config.model_config is not None else resolve(config)
    start_time = time.perf_counter()
    parallel.initialize(config.parallel.tensor_model_parallel_size,
                        config.parallel.pipeline_model_parallel_size, seed=config.run.seed,
                        virtual_pipeline=config.parallel.virtual_pipeline(config.model_config.layers))
    # Several ranks (nodes): --save must be one directory all of them see, --load the same checkpoint
    # everywhere; else one error line now, not a lost save later (docs/MULTI_NODE.md).
    check_shared_checkpoints(config.checkpoint.save, config.load_dir)
    # The tokenizer, task source and prompt format resolve built to check the flags (built once).
    inputs = run_inputs(config)
    tokenizer, tasks = inputs.tokenizer, inputs.tasks
    model, ddp, optimizer = build_trainable(config.model_config, config.optimizer, config.logra,
                                            dtype=_dtype(config), seed=config.run.seed,
                                            recompute=config.recompute,
                                            attention_backend=config.model.attention_backend,
                                            overlap_grad_reduce=config.parallel.overlap_grad_reduce,
                                            overlap_param_gather=config.parallel.overlap_param_gather,
                                            sequence_parallel=config.parallel.sequence_parallel)
    state = TrainerState()
    if config.load_dir:
        state = TrainerState.from_checkpoint(load_training_state(
            config.load_dir, model, optimizer, optimizer_compatibility(config),
            load_optim=config.checkpoint.load_optim))
    controller = PredictedKLController(config.kl, train_iters=config.run.train_iters)
    controller.load_state_dict(state.controller)
    output_dir = config.run.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    logger = MetricsLogger(output_dir, config.run.tensorboard_dir or os.path.join(output_dir, "tensorboard"),
                           total=config.run.train_iters, progress=config.run.progress,
                           log_interval=config.run.log_interval, first_step=state.step,
                           warmup_done=state.warmup_done, wandb_settings=config.run.wandb_settings(output_dir))
    return Run(config=config, tokenizer=tokenizer, tasks=tasks, model=model, ddp=ddp, optimizer=optimizer,
               engine=build_rollout_engine(config.rollout.engine, ddp, model_config=config.model_config,
                                           vocab_size=tokenizer.vocab_size,
                                           sync_bucket_mb=config.rollout.sync_bucket_mb, optimizer=optimizer,
                                           policy_sync=config.rollout.policy_sync,
                                           full_sync_interval=config.rollout.full_sync_interval),
               controller=controller, logger=logger,
               reward=RewardRunner(get_reward(config.reward.name), timeout_s=config.reward.timeout_s,
                                   workers=config.reward.workers),
               prompt_format=inputs.prompt_format,
               held_out=tasks.held_out(config.run.eval_prompts),
               state=state, start_time=start_time)


def evaluate(run: Run, samples: int = 0) -> EvalResult:
    """Greedy pass@1 (and with ``samples``, sampled pass@k) on the held-out records, split over
    DP replicas: a completion is correct when the run's reward gives it full credit (>= 1)."""
    config = run.config
    base = dataclasses.replace(config.sampling, vocab_size=run.vocab)
    return evaluate_records(run.engine, run.tokenizer, run.prompt_format.prompt, run.reward, run.held_out, base,
                            samples=samples, temperature=config.sampling.temperature,
                            seed=config.run.seed * SAMPLING_SEED_PER_RUN + EVAL_SAMPLING_SEED)


def record_accuracy(run: Run, key: str, when: str) -> None:
    result = evaluate(run, run.config.run.eval_samples)
    run.state.summary[key] = round(100.0 * result.greedy_pass_at_1, 2)
    run.state.summary[key.replace("held_out_accuracy", "evaluation")] = result.to_dict()
    run.logger.info(f"held-out accuracy ({when}): {run.state.summary[key]:.1f}%")
    if result.samples:
        run.logger.info(f"  {result.summary_line()}")


def supervised_warmup(run: Run) -> None:
    """Teach the answer format so RL has reward to work with: next-token loss on the answer
    and EOS of training prompts, the lr set by Megatron's scheduler (constant, or a cosine to
    ``--warmup-min-lr``)."""
    config = run.config
    warmup = config.warmup
    scheduler = build_scheduler(
        run.optimizer, max_lr=warmup.lr, min_lr=warmup.lr if warmup.min_lr is None else warmup.min_lr,
        decay_steps=max(1, warmup.iters - 1), decay_style="constant" if warmup.min_lr is None else "cosine",
        weight_decay=config.optimizer.weight_decay)
    seq_length = rollout_length(run) + SEQ_LENGTH_MARGIN
    # The model sees tokens[:, :-1]; under sequence parallelism their width divides by TP.
    multiple = sequence_multiple(run.model)
    seq_length = 1 + round_up(seq_length - 1, multiple)
    batch = config.rollout.prompts_per_step * config.advantages.group_size
    for step in range(warmup.iters):
        records = _my_share(run.tasks.train_prompts(batch, step=WARMUP_PROMPT_STREAM + step))
        tokens, mask = supervised_batch(records, run.tokenizer, seq_length, run.prompt_format)
        micro = min(config.run.micro_batch_size, len(records))
        loss, grad_norm = train_step(run.ddp, run.optimizer, lambda m: lm_forward_backward(
            m, tokens, micro, loss_mask=mask, vocab_size=run.vocab))
        scheduler.step(1)
        run.logger.warmup(step, warmup.iters, loss, grad_norm)
    if warmup.iters:
        gather_updated_weights(run.ddp)
        run.engine.sync_weights(run.ddp)  # an engine with its own weights samples the warmed-up policy


def rl_scheduler(run: Run):
    """The RL lr: warm-up over ``--lr-warmup-iters``, then a decay from ``--lr`` to ``--min-lr``
    over ``--lr-decay-iters`` (default ``--train-iters``); positioned at the resumed step."""
    config = run.config
    scheduler = build_scheduler(
        run.optimizer, max_lr=config.optimizer.lr, min_lr=config.lr_schedule.min_lr,
        decay_steps=config.lr_schedule.decay_iters(config.run.train_iters),
        decay_style=config.lr_schedule.lr_decay_style, warmup_steps=config.lr_schedule.lr_warmup_iters,
        weight_decay=config.optimizer.weight_decay, wsd_decay_steps=config.lr_schedule.lr_wsd_decay_iters,
        wsd_decay_style=config.lr_schedule.lr_wsd_decay_style)
    scheduler.step(run.state.step - run.state.skipped_steps)
    return scheduler


def rl_step(run: Run, step: int) -> dict:
    """One GRPO step; returns its metrics (agreed on every rank)."""
    config, tokenizer, ddp = run.config, run.tokenizer, run.ddp
    group_size = config.advantages.group_size
    step_start = time.perf_counter()
    records = _my_share(run.tasks.train_prompts(config.rollout.prompts_per_step, step=step))
    seed = config.run.seed * SAMPLING_SEED_PER_RUN + step * SAMPLING_SEED_PER_STEP + parallel.dp_rank()
    sampling = dataclasses.replace(config.sampling, samples_per_prompt=group_size, eos_id=tokenizer.eos_id,
                        pad_id=tokenizer.pad_id, vocab_size=run.vocab, seed=seed)
    rollouts = run.engine.generate([tokenizer.encode(run.prompt_format.prompt(r)) for r in records], sampling)
    texts = [tokenizer.decode(c) for c in rollouts.completions()]
    # Rewards are scored on the host (Python verifiers, the sandbox); the tensor serves the
    # advantages and the loss, on the rollouts' device.
    scores = run.reward.score_batch([records[i // group_size] for i in range(len(texts))], texts)
    rewards = torch.tensor(scores, device=rollouts.tokens.device)
    reward_failures = run.reward.take_failures()  # (evaluation's are counted with the next step)
    if reward_failures["reward_failures"] and run.reward.recent_failures:
        run.logger.info(f"step {step}: {int(reward_failures['reward_failures'])} reward(s) failed and scored 0; "
                        f"last: {run.reward.recent_failures[-1]}")
    advantages = group_advantages(rewards, config.advantages)

    tied = tied_groups(rewards, group_size)
    rows = kept_rows(rewards, group_size, config.advantages.dynamic_sampling)
    batch, batch_advantages = select_rows(rollouts, rows, advantages)
    # The step's rows spread over DP replicas by token count (each optimizer step keeps its rows).
    batch, batch_advantages, balance = balance_batch(batch, batch_advantages, config.loss.num_minibatches,
                                                     tokenizer.pad_id, enabled=config.run.balance_batch)

    # Old (and reference) log-probs once per batch: every optimizer step below reuses them.
    micro = min(config.run.micro_batch_size, batch.num_sequences)
    temperature = config.sampling.temperature
    packing = packing_options(config)
    if not packing["pack"]:  # padded passes (the probe's too) split the batch's width over SP's ranks
        batch = widen_to_multiple(batch, sequence_multiple(ddp))
    old_logprobs, _ = sequence_logprobs(ddp, batch, micro, temperature, run.vocab, **packing)
    # The engine's own log-probs of the sampled tokens (engines that return them), laid out like
    # old_logprobs (position t scores token t + 1): --tis-cap's weights and the mismatch metrics.
    engine_logprobs = None if batch.logprobs is None else batch.logprobs[:, 1:]
    mismatch = engine_mismatch(engine_logprobs, old_logprobs, batch.response_mask[:, 1:])
    if mismatch:  # --kl-subtract-mismatch: this batch's mismatch lowers the steps' KL budget
        run.controller.observe_mismatch(mismatch["logp_mismatch_kl"])
    ref_logprobs = None
    if run.reference is not None:
        ref_logprobs, _ = sequence_logprobs(run.reference, batch, micro, temperature, run.vocab, **packing)
    steps = []
    for _epoch in range(config.loss.ppo_epochs):
        for part in split_minibatches(torch.arange(batch.num_sequences, device=rollouts.tokens.device),
                                      config.loss.num_minibatches):
            steps.append(optimizer_step(run, *select_rows(batch, part, batch_advantages, old_logprobs, ref_logprobs,
                                                          engine_logprobs)))
    control = combine_steps(steps)
    sync = {"sync_bytes": 0.0, "sync_time_s": 0.0}
    if control["success"]:
        gather_updated_weights(ddp)  # --overlap-param-gather: the sync reads the weights directly
        sync = run.engine.sync_weights(ddp)
        count_sync(run.state.summary, sync)

    elapsed = time.perf_counter() - step_start
    agree = parallel.agree_on_scalar
    return {
        "reward_mean": agree(float(rewards.mean())),
        "reward_std": agree(float(rewards.std())),
        "accuracy": 100.0 * agree(float((rewards >= 1.0).float().mean())),
        "grad_norm": control["grad_norm"], **{k: v for k, v in control.items() if k.startswith("grad_norm_")},
        "kl_pred": control["kl_pred"],
        "kl_realized": control["kl_realized"], "step_scale": control["step_scale"],
        **{key: agree(value) * parallel.dp_size() for key, value in reward_failures.items()},
        "skipped": 0.0 if control["success"] else 1.0, "skipped_steps": float(run.state.skipped_steps + (not control["success"])),
        "controller_time_s": control["controller_time_s"],
        "controller_extra_bytes": float(control["controller_extra_bytes"]),
        **mismatch, **balance, "kl_budget": run.controller.budget(),
        "tokens_per_s": agree(float(rollouts.response_mask.sum())) * parallel.dp_size() / elapsed,
        "tied_group_share": agree(float(tied.float().mean())),
        "sequences_in_loss": agree(float(batch.num_sequences)) * parallel.dp_size(),
        "optimizer_steps": float(len(steps)),
        "lr": run.optimizer.param_groups[0]["lr"], "step_time_s": elapsed,
        # what the weight sync into the rollout engine moved and took (0 for the embedded engine)
        "sync_bytes": float(sync["sync_bytes"]), "sync_time_s": float(sync["sync_time_s"]),
        "sync_low_rank": float(sync.get("sync_low_rank", 0.0)),
        # grads + optimizer states + projections this rank actually holds (TensorBoard: memory)
        "state_bytes": float(sum(run.optimizer.state_bytes().values())),
        **{k: v for k, v in control.items() if k in ("loss", "pg_loss", "entropy", "clip_fraction",
                                                       "dual_clip_fraction", "ratio_mean", "ratio_max", "kl",
                                                       "tis_weight_mean")},
    }


def packing_options(config) -> dict:
    """The GRPO passes' packing (``pack``, ``max_tokens``): on unless ``--no-pack-sequences`` or the
    unfused attention backend (Megatron's DotProductAttention takes no packed sequences)."""
    pack = config.run.pack_sequences and resolve_attention_backend(config.model.attention_backend) == "sdpa"
    return {"pack": pack, "max_tokens": config.run.max_tokens_per_microbatch}


def optimizer_step(run: Run, rollouts, advantages, old_logprobs, ref_logprobs, engine_logprobs=None) -> dict:
    """One KL-controlled optimizer step on a minibatch: the policy loss's backward, then the
    controller's propose -> forecast -> scale -> commit (nothing committed when the loss is not
    finite). Returns the loss's metrics and the controller's."""
    config, ddp = run.config, run.ddp
    micro = min(config.run.micro_batch_size, rollouts.num_sequences)
    for chunk in model_chunks(ddp):
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    # The KL probe: completions spread over the minibatch's prompts, and rows it does not see for
    # the realized KL out of sample. They are rows of this minibatch, so the loss's forward keeps
    # their s = 0 logits for the controller (no forward pass of the probe recomputes them).
    probe, held_out = probe_and_held_out(rollouts, config.kl.probe_sequences, micro, run.vocab,
                                         multiple=sequence_multiple(ddp), **packing_options(config))
    step_logits = run.controller.step_logits(probe, held_out)
    loss_metrics = policy_loss_backward(ddp, rollouts, advantages, old_logprobs, micro, config.loss,
                                        ref_logprobs=ref_logprobs, temperature=config.sampling.temperature,
                                        vocab_size=run.vocab, engine_logprobs=engine_logprobs,
                                        keep_logits=step_logits, **packing_options(config))
    loss_metrics["loss"] = nan_point("rl:loss", loss_metrics["loss"])  # (fault-injection tests only)
    if math.isfinite(loss_metrics["loss"]):  # (agreed on every rank)
        control = run.controller.step(ddp, run.optimizer, probe, held_out, step_logits)
    else:  # a non-finite loss: no step (the gradients are cleared before the next backward)
        control = dict(SKIPPED_STEP)
    # The optimizer's own view of the step's gradient norms (LoGRA: with the estimate outside
    # the sketch, what clipping used) replaces the controller's when the step ran.
    diagnostics = run.optimizer.diagnostics() if control["grad_norm"] is not None else {}
    return {**loss_metrics, **control, **diagnostics}


def engine_mismatch(engine_logprobs, trainer_logprobs, mask) -> dict:
    """``logp_mismatch_mean`` / ``logp_mismatch_max``: mean and max of |engine - trainer| log-prob
    over the batch's response tokens; ``logp_mismatch_kl``: the KL from the engine's sampling
    distribution to the trainer's, estimated on those tokens (sampled by the engine) with the
    non-negative estimator ``r - 1 - log r``, ``r = p_trainer / p_engine`` (what
    ``--kl-subtract-mismatch`` subtracts from the KL budget: a KL, in the budget's units). Agreed
    over replicas (means of means, the max); nothing for an engine that returns no log-probs."""
    if engine_logprobs is None:
        return {}
    mask = mask.bool()
    log_ratio = (trainer_logprobs - engine_logprobs).double()[mask]
    gap = log_ratio.abs()
    kl = log_ratio.exp() - 1.0 - log_ratio
    agree = parallel.agree_on_scalar
    return {"logp_mismatch_mean": agree(float(gap.mean()) if gap.numel() else 0.0),
            "logp_mismatch_max": agree(float(gap.max()) if gap.numel() else 0.0, op="max"),
            "logp_mismatch_kl": agree(float(kl.mean()) if kl.numel() else 0.0)}


def count_skips(run: Run, skipped: bool) -> None:
    """Count skipped steps; ``--max-consecutive-skips`` in a row stop the run, after saving the
    last good state (a skipped step changed no weight)."""
    state = run.state
    state.consecutive_skips = state.consecutive_skips + 1 if skipped else 0
    state.skipped_steps += int(skipped)
    if skipped:
        run.logger.info(f"step {state.step}: skipped (a non-finite loss, gradient, sketch or KL forecast); "
                        f"{state.skipped_steps} skipped so far")
    limit = run.config.run.max_consecutive_skips
    if limit and state.consecutive_skips >= limit:
        where = ""
        if run.config.checkpoint.save:
            save(run)
            where = f"; the last good state is saved in {run.config.checkpoint.save} (resume with --load)"
        raise UserError(f"stopping at step {state.step}: {state.consecutive_skips} consecutive steps were skipped "
                        f"for non-finite values{where}; lower --lr or check the rewards and data")


def should_exit(run: Run) -> bool:
    """``--exit-interval``: stop (the caller saves with ``--save``) at a multiple of it."""
    step, interval = run.state.step, run.config.run.exit_interval
    if not interval or step % interval or step >= run.config.run.train_iters:
        return False
    save_hint = "; continue with --load " + run.config.checkpoint.save if run.config.checkpoint.save else ""
    run.logger.info(f"exiting after iteration {step} (--exit-interval){save_hint}")
    return True


def preemption_line(run: Run, signal_name: str) -> str:
    """What a preempted run says last: where it stopped, what it saved and how to go on."""
    step, root = run.state.step, run.config.checkpoint.save
    if not root:
        return (f"preempted by {signal_name}: stopped after iteration {step}; nothing was saved (no --save), "
                "a new run starts over")
    return (f"preempted by {signal_name}: stopped after iteration {step} and saved "
            f"{iteration_dir(root, step)}; continue with --load {root}")


def save(run: Run) -> None:
    config = run.config
    run.state.controller = run.controller.state_dict()
    gather_updated_weights(run.ddp)  # --overlap-param-gather: the save reads the weights directly
    kind, path = run_tokenizer_files(config.model, config.load_dir)
    args = megatron_lm_args(config.model_config, config.parallel.tensor_model_parallel_size,
                            config.parallel.pipeline_model_parallel_size, iteration=run.state.step,
                            virtual_pipeline=config.parallel.virtual_pipeline(config.model_config.layers),
                            bf16=config.model.bf16, tokenizer_type=kind, tokenizer_model=path,
                            seq_length=config.rollout.seq_length)
    save_training_state(config.checkpoint.save, run.model, run.optimizer, config.model_config,
                        dataclasses.asdict(run.state), optimizer_compatibility(config),
                        keep=config.checkpoint.keep_checkpoints, megatron_args=args,
                        # a Hugging Face tokenizer folder travels with the checkpoint: a resume needs no flag
                        tokenizer_dir=path if kind in HUGGINGFACE_TYPES and os.path.isdir(path) else None)


def write_summary(run: Run, finished: bool) -> dict:
    config = run.config
    planned = [state_bytes(chunk, config.logra) for chunk in model_chunks(run.model)]
    summary = run.state.summary
    summary.update({
        "steps": run.state.step, "finished": finished, "optimizer": config.optimizer.kind,
        "preset": config.model.preset, "kl_control": config.kl.mode,
        "num_attention_heads": config.model_config.heads, "num_query_groups": config.model_config.kv_heads,
        "rollout_engine": config.rollout.engine, "policy_sync": config.rollout.policy_sync,
        "wall_time_s": time.perf_counter() - run.start_time,
        "state_bytes": {kind: sum(chunk[kind].total for chunk in planned) for kind in ("dense", "logra")},
        "tensor_model_parallel_size": parallel.tp_size(),
        "pipeline_model_parallel_size": parallel.pp_size(),
        "data_parallel_size": parallel.dp_size(),
        # the model as built (Megatron's config), not the flag: what the run really did
        "sequence_parallel": bool(unwrap_model(model_chunks(run.model)[0]).config.sequence_parallel),
        "virtual_pipeline_model_parallel_size": len(run.model) if isinstance(run.model, list) else None,
    })
    summary["reward_failures"] = dict(run.reward.failures)
    run.reward.close()
    close_engine = getattr(run.engine, "close", None)
    if close_engine is not None:  # an engine with resources of its own (vllm), before the groups go
        close_engine()
    path = run.logger.finish(summary)
    return summary if path is None else dict(summary, summary_path=path)


# --- helpers -----------------------------------------------------------------------------------

def count_sync(summary: dict, sync: dict) -> None:
    """Add one weight sync to the summary's totals (``weight_sync``): syncs, low-rank ones, bytes
    and seconds, and the bytes as a share of a full sync every time (the last full sync's size)."""
    totals = summary.setdefault("weight_sync", {"syncs": 0, "low_rank_syncs": 0, "bytes": 0.0, "time_s": 0.0,
                                                "restarts": 0})
    totals["syncs"] += 1
    totals["low_rank_syncs"] += int(sync.get("sync_low_rank", 0.0))
    totals["bytes"] += float(sync["sync_bytes"])
    totals["time_s"] += float(sync["sync_time_s"])
    totals["restarts"] = int(sync.get("sync_restarts", 0.0))
    full = float(sync.get("sync_full_bytes", 0.0))
    if full > 0:
        totals["full_sync_bytes"] = full
        totals["bytes_ratio_to_full"] = totals["bytes"] / (totals["syncs"] * full)


def rollout_length(run: Run) -> int:
    """Tokens of the longest held-out prompt plus ``--max-new-tokens``: a rollout's width."""
    return (max(len(run.tokenizer.encode(run.prompt_format.prompt(r))) for r in run.held_out)
            + run.config.sampling.max_new_tokens)


def supervised_batch(records, tokenizer, seq_length, prompt_format: Optional[PromptFormat] = None):
    """Right-padded ``prompt answer <eos>`` rows and a loss mask on the answer and EOS; the prompt
    and the answer as ``prompt_format`` shows them (default: bare problem text and answer)."""
    # Built on the host from token lists; lm_forward_backward moves the batch to the model's device.
    tokens = torch.full((len(records), seq_length), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(records), seq_length)
    for row, record in enumerate(records):
        prompt = tokenizer.encode(prompt_format.prompt(record) if prompt_format else record["prompt"])
        reply = prompt_format.reply(record) if prompt_format else record["answer"]
        answer = tokenizer.encode(reply) + [tokenizer.eos_id]
        ids = (prompt + answer)[:seq_length]
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, len(prompt) : len(ids)] = 1.0
    return tokens, mask


def frozen_reference(run: Run):
    """A frozen copy of the policy as it enters the RL phase (after any warm-up; on a resumed
    run, as it was at the resume point), for the KL-to-reference penalty; chunk by chunk under a
    virtual pipeline (a list, as the policy's)."""
    model_config = run.config.model_config
    policy = model_chunks(run.model)
    virtual = len(policy) if isinstance(run.model, list) else None
    config = transformer_config(model_config, parallel.tp_size(), parallel.pp_size(), dtype=_dtype(run.config),
                                sequence_parallel=run.config.parallel.sequence_parallel, virtual_pipeline=virtual)
    spec = gpt_layer_spec(use_transformer_engine=False, attention_backend=run.config.model.attention_backend)
    chunks = []
    for vp_stage, chunk in enumerate(policy):
        reference = build_gpt_model(model_config, config, spec, vp_stage=vp_stage if virtual else None)
        reference.load_state_dict(chunk.state_dict())  # built on the policy's device
        for param in reference.parameters():
            param.requires_grad_(False)
        chunks.append(reference.eval())
    return chunks if virtual else chunks[0]


def _my_share(items: list) -> list:
    per = len(items) // parallel.dp_size()
    return items[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]


def _dtype(config: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if config.model.bf16 else torch.float32
