"""The GRPO trainer loop, top to bottom.

    initialize -> tokenizer, tasks -> model + optimizer (LoGRA or dense Adam)
    evaluate (initial) -> supervised warm-up (optional) -> evaluate (before RL)
    for each step:
        prompts -> rollouts (current policy, KV cache) -> rewards -> group advantages
        -> old log-probs (and reference log-probs) -> policy loss through the pipeline schedule
        -> optimizer step under predicted-KL control -> log -> save
    evaluate (after RL) -> summary.json

Every rank runs the same code; data-parallel replicas take their own share of the prompts.
"""

import json
import math
import os
import time

import torch

from logra_megatron import parallel
from logra_megatron.config import TrainConfig
from logra_megatron.logra.accounting import measured_state_bytes, state_bytes
from logra_megatron.training.kl_control import PredictedKLController
from logra_megatron.rl.advantages import AdvantageConfig, group_advantages
from logra_megatron.rl.grpo import policy_loss_backward, probe_rows, rollout_logits, sequence_logprobs
from logra_megatron.rl.losses import PolicyLossConfig
from logra_megatron.rl.metrics import MetricsLogger
from logra_megatron.rl.rewards import get_reward
from logra_megatron.rollout.megatron_engine import generate
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.rl.tasks import ArithmeticTaskConfig, ArithmeticTasks
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable, reset_optimizer_state, train_step


def _tokenizer(config: TrainConfig, tasks: ArithmeticTasks):
    from logra_megatron.tokenizer import build_tokenizer, default_task_tokenizer

    if config.run.tokenizer_model:
        return build_tokenizer(config.run.tokenizer_type, config.run.tokenizer_model)
    if config.run.load and os.path.isfile(os.path.join(config.run.load, "tokenizer", "tokenizer.json")):
        # A converted Hugging Face checkpoint carries its tokenizer.
        return build_tokenizer("HuggingFaceTokenizer", os.path.join(config.run.load, "tokenizer"))
    cache = os.environ.get("LOGRA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "logra_megatron"))
    return default_task_tokenizer(cache)  # character-level: the same for every operand range


def _my_share(items: list) -> list:
    per = len(items) // parallel.dp_size()
    return items[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]


def _dp_mean(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if parallel.dp_size() > 1:
        torch.distributed.all_reduce(tensor, group=parallel.dp_group())
    return float(tensor) / parallel.dp_size()


def evaluate(model, records, tokenizer, max_new_tokens, vocab_size, reward=None) -> float:
    """Greedy accuracy (percent) on ``records`` (split over DP replicas): a completion is
    correct when ``reward`` (default: exact match) gives it full credit (>= 1)."""
    mine = _my_share(records)
    config = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id, vocab_size=vocab_size)
    rollouts = generate(model, [tokenizer.encode(r["prompt"]) for r in mine], config)
    reward = reward or get_reward("exact_match")
    correct = sum(reward(record, tokenizer.decode(completion)) >= 1.0
                  for record, completion in zip(mine, rollouts.completions()))
    return round(100.0 * _dp_mean(correct / max(1, len(mine))), 2)


def supervised_batch(records, tokenizer, seq_length):
    """Right-padded ``prompt answer <eos>`` rows and a loss mask on the answer and EOS."""
    tokens = torch.full((len(records), seq_length), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(records), seq_length)
    for row, record in enumerate(records):
        prompt = tokenizer.encode(record["prompt"])
        answer = tokenizer.encode(record["answer"]) + [tokenizer.eos_id]
        ids = (prompt + answer)[:seq_length]
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, len(prompt) : len(ids)] = 1.0
    return tokens, mask


def train(config: TrainConfig) -> dict:
    run, grpo = config.run, config.grpo
    start_time = time.perf_counter()
    parallel.initialize(run.tensor_model_parallel_size, run.pipeline_model_parallel_size, seed=run.seed)
    tasks = ArithmeticTasks(ArithmeticTaskConfig(max_operand=grpo.max_operand, seed=run.seed,
                                                      held_out_fraction=grpo.held_out_fraction))
    tokenizer = _tokenizer(config, tasks)
    model_config = config.model
    if run.load:
        from logra_megatron.checkpoint import load_model_config

        model_config = load_model_config(run.load)  # the checkpoint decides the architecture
    elif run.tokenizer_model is None and config.preset == "tiny":
        model_config = model_config.with_changes(vocab=tokenizer.vocab_size)
    if tokenizer.vocab_size > model_config.vocab:
        from logra_megatron.errors import UserError

        raise UserError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {model_config.vocab}")
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    model, ddp, optimizer = build_trainable(model_config, config.optimizer, config.logra, dtype=dtype,
                                            seed=run.seed)
    controller = PredictedKLController(config.kl)
    logger = MetricsLogger(run.output_dir, run.tensorboard_dir, total=run.train_iters, progress=run.progress,
                           log_interval=run.log_interval)
    reward_fn = get_reward(grpo.reward)
    loss_config = PolicyLossConfig(clip_low=grpo.clip_low, clip_high=grpo.clip_high, kl_coef=grpo.kl_coef,
                                   kl_estimator=grpo.kl_estimator, entropy_coef=grpo.entropy_coef)
    held_out = tasks.held_out(run.eval_prompts)
    vocab = tokenizer.vocab_size
    seq_length = max(len(tokenizer.encode(r["prompt"])) for r in held_out) + grpo.max_new_tokens + 4

    state = {"step": 0, "warmup_done": False, "summary": {}}
    if run.load:
        from logra_megatron.rl.checkpointing import load_training_state

        state = load_training_state(run.load, model, optimizer)
    summary = state["summary"]
    if "held_out_accuracy_initial" not in summary:
        summary["held_out_accuracy_initial"] = evaluate(ddp, held_out, tokenizer, grpo.max_new_tokens, vocab, reward_fn)
        logger.info(f"held-out accuracy (initial): {summary['held_out_accuracy_initial']:.1f}%")

    # --- supervised warm-up: teach the answer format so RL has reward to work with ------------
    if not state["warmup_done"]:
        for step in range(run.warmup_iters):
            for group in optimizer.param_groups:
                group["lr"] = _warmup_lr(run, step)
            records = _my_share(tasks.train_prompts(grpo.prompts_per_step * grpo.group_size, step=100_000 + step))
            tokens, mask = supervised_batch(records, tokenizer, seq_length)
            loss, grad_norm = train_step(ddp, optimizer, lambda m: lm_forward_backward(
                m, tokens, min(run.micro_batch_size, len(records)), loss_mask=mask, vocab_size=vocab))
            logger.warmup(step, run.warmup_iters, loss, grad_norm)
        state["warmup_done"] = True
        reset_optimizer_state(optimizer)  # RL starts from clean moments (training/setup.py)
        summary["warmup_iters"] = run.warmup_iters
        summary["held_out_accuracy_before"] = evaluate(ddp, held_out, tokenizer, grpo.max_new_tokens, vocab, reward_fn)
        logger.info(f"held-out accuracy (start of RL): {summary['held_out_accuracy_before']:.1f}%")
    scheduler = _lr_scheduler(optimizer, config)
    scheduler.step(state["step"])
    reference = _frozen_reference(model, model_config, dtype) if grpo.kl_coef > 0 else None

    # --- RL ----------------------------------------------------------------------------------
    saved_step = None
    for step in range(state["step"], run.train_iters):
        step_start = time.perf_counter()
        records = _my_share(tasks.train_prompts(grpo.prompts_per_step, step=step))
        sampling = SamplingConfig(temperature=grpo.temperature, top_p=grpo.top_p, top_k=grpo.top_k,
                                  max_new_tokens=grpo.max_new_tokens, samples_per_prompt=grpo.group_size,
                                  eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, vocab_size=vocab,
                                  seed=run.seed * 1_000_003 + step * 1009 + parallel.dp_rank())
        rollouts = generate(ddp, [tokenizer.encode(r["prompt"]) for r in records], sampling)
        texts = [tokenizer.decode(c) for c in rollouts.completions()]
        rewards = torch.tensor([reward_fn(records[i // grpo.group_size], text) for i, text in enumerate(texts)])
        advantages = group_advantages(rewards, AdvantageConfig(group_size=grpo.group_size,
                                                               normalize_std=grpo.normalize_std))
        micro = min(run.micro_batch_size, rollouts.tokens.shape[0])
        old_logprobs, _ = sequence_logprobs(ddp, rollouts, micro, grpo.temperature, vocab)
        ref_logprobs = None
        if reference is not None:
            ref_logprobs, _ = sequence_logprobs(reference, rollouts, micro, grpo.temperature, vocab)

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss_metrics = policy_loss_backward(ddp, rollouts, advantages, old_logprobs, micro, loss_config,
                                            ref_logprobs=ref_logprobs, temperature=grpo.temperature,
                                            vocab_size=vocab)
        # Probe: completions spread over the batch's prompts; position t predicts token t+1.
        probe = probe_rows(rollouts, config.kl.probe_sequences)
        probe_mask = torch.zeros_like(rollouts.response_mask[probe], dtype=torch.float)
        probe_mask[:, :-1] = rollouts.response_mask[probe, 1:].float()
        control = controller.step(ddp, optimizer, rollouts.tokens[probe], probe_mask,
                                  logits_fn=lambda m: rollout_logits(m, rollouts, probe, micro, vocab))
        scheduler.step(1)

        elapsed = time.perf_counter() - step_start
        generated = float(rollouts.response_mask.sum())
        metrics = {
            "reward_mean": _dp_mean(float(rewards.mean())),
            "reward_std": _dp_mean(float(rewards.std())),
            "accuracy": 100.0 * _dp_mean(float((rewards >= 1.0).float().mean())),
            "grad_norm": control["grad_norm"], "kl_pred": control["kl_pred"],
            "kl_realized": control["kl_realized"], "step_scale": control["step_scale"],
            "controller_time_s": control["controller_time_s"],
            "tokens_per_s": _dp_mean(generated) * parallel.dp_size() / elapsed,
            "lr": optimizer.param_groups[0]["lr"], "step_time_s": elapsed,
            # grads + optimizer states + projections this rank actually holds (TensorBoard: memory)
            "state_bytes": float(sum(measured_state_bytes(ddp, optimizer).values())),
            **{k: v for k, v in loss_metrics.items() if k in ("loss", "pg_loss", "entropy", "clip_fraction", "kl")},
        }
        logger.step(step, metrics)
        state["step"] = step + 1
        if run.save and run.save_interval and state["step"] % run.save_interval == 0:
            from logra_megatron.rl.checkpointing import save_training_state

            save_training_state(run.save, model, optimizer, model_config, state)
            saved_step = state["step"]
        if run.exit_interval and state["step"] % run.exit_interval == 0 and state["step"] < run.train_iters:
            logger.info(f"exiting after iteration {state['step']} (--exit-interval)"
                        + ("; continue with --load " + run.save if run.save else ""))
            break

    finished = state["step"] >= run.train_iters
    if finished:
        summary["held_out_accuracy_after"] = evaluate(ddp, held_out, tokenizer, grpo.max_new_tokens, vocab,
                                                      reward_fn)
        logger.info(f"held-out accuracy (after RL): {summary['held_out_accuracy_after']:.1f}%")
    if run.save and saved_step != state["step"]:
        from logra_megatron.rl.checkpointing import save_training_state

        save_training_state(run.save, model, optimizer, model_config, state)
    bytes_ = state_bytes(model, config.logra)
    summary.update({
        "steps": state["step"], "finished": finished, "optimizer": config.optimizer.kind, "preset": config.preset,
        "kl_control": config.kl.mode, "wall_time_s": time.perf_counter() - start_time,
        "state_bytes": {"dense": bytes_["dense"].total, "logra": bytes_["logra"].total},
        "tensor_model_parallel_size": parallel.tp_size(),
        "pipeline_model_parallel_size": parallel.pp_size(),
        "data_parallel_size": parallel.dp_size(),
    })
    path = logger.finish(summary)
    return summary if path is None else dict(summary, summary_path=path)


def _warmup_lr(run, step: int) -> float:
    """The warm-up's learning rate at ``step``: constant, or cosine from warmup_lr to warmup_min_lr."""
    if run.warmup_min_lr is None or run.warmup_iters <= 1:
        return run.warmup_lr
    progress = step / (run.warmup_iters - 1)
    return run.warmup_min_lr + 0.5 * (run.warmup_lr - run.warmup_min_lr) * (1 + math.cos(math.pi * progress))


def _frozen_reference(model, model_config, dtype):
    """A frozen copy of the policy as it enters the RL phase (after any warm-up; on a resumed
    run, as it was at the resume point), for the KL-to-reference penalty."""
    from logra_megatron.models import build_gpt_model, gpt_layer_spec, transformer_config

    config = transformer_config(model_config, parallel.tp_size(), parallel.pp_size(), dtype=dtype)
    reference = build_gpt_model(model_config, config, gpt_layer_spec(use_transformer_engine=False))
    reference.load_state_dict(model.state_dict())
    for param in reference.parameters():
        param.requires_grad_(False)
    return reference.eval()


def _lr_scheduler(optimizer, config: TrainConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr = config.optimizer.lr
    min_lr = config.extras.get("min_lr", 0.0)
    warmup = config.extras.get("lr_warmup_iters", 0)
    for group in optimizer.param_groups:  # Megatron's groups carry None for these by default
        group["max_lr"], group["min_lr"] = lr, min_lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(config.run.train_iters, warmup + 1), lr_decay_style="cosine",
        start_wd=config.optimizer.weight_decay, end_wd=config.optimizer.weight_decay,
        wd_incr_steps=max(config.run.train_iters, 1), wd_incr_style="constant")
