"""The trainer's own memory plan: the run's settings as the planner's
(:mod:`logra_megatron.planning`), so that a run states at start-up what each GPU of its layout
should hold, dense Adam beside the chosen optimizer, before the first step measures it."""

from logra_megatron.errors import UserError
from logra_megatron.ops.multiples import ceil_div
from logra_megatron.planning.plan import plan_memory
from logra_megatron.planning.settings import PlanSettings, RolloutPlan
from logra_megatron.rl.packing import default_token_budget
from logra_megatron.rollout.engine import engine_memory

MIB = 2 ** 20


def plan_settings(config, world_size: int, seq_length: int, optimizer: str) -> PlanSettings:
    """:class:`PlanSettings` of a resolved :class:`~logra_megatron.rl.config.TrainConfig` for
    ``optimizer``: one optimizer step's sequences (the batch over ``--num-minibatches``) of
    ``seq_length`` tokens in the run's microbatches (packed up to its token budget, the default
    one resolved as the GRPO passes resolve it, unless ``--no-pack-sequences``), the rollout
    batch in flight through the trainer's own weights (the embedded Megatron engine), a reference
    model when the KL penalty is on."""
    tp = config.parallel.tensor_model_parallel_size
    pp = config.parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    rollout_rows = config.rollout.prompts_per_step * config.advantages.group_size
    step_rows = max(1, rollout_rows // dp // config.loss.num_minibatches)  # one step's rows per replica
    micro = min(config.run.micro_batch_size, step_rows)  # as the trainer's optimizer_step takes it
    budget = config.run.max_tokens_per_microbatch or default_token_budget(micro, seq_length)
    recompute = config.recompute
    return PlanSettings(
        model=config.model_config, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
        virtual_pipeline=config.parallel.virtual_pipeline(config.model_config.layers),
        sequence_parallel=config.parallel.sequence_parallel,
        optimizer=optimizer, distributed_optimizer=config.optimizer.distributed, bf16=config.model.bf16,
        logra=config.logra, kl_control=config.kl.mode, kl_probe_sequences=config.kl.probe_sequences,
        micro_batch_size=micro, global_batch_size=(step_rows // micro) * micro * dp,
        pack_sequences=config.run.pack_sequences, max_tokens_per_microbatch=budget,
        seq_length=seq_length, recompute_granularity=recompute.granularity or "none",
        recompute_method=recompute.method, recompute_num_layers=recompute.num_layers,
        attention_backend=config.model.attention_backend, reference_model=config.loss.kl_coef > 0,
        rollout=RolloutPlan(sequences_in_flight=ceil_div(rollout_rows, dp), max_tokens=seq_length,
                            dtype_bytes=2 if config.model.bf16 else 4, engine=engine_memory(config.rollout.engine)))


def plan_summary(config, world_size: int, seq_length: int) -> dict:
    """``{optimizer: planned bytes per GPU of the busiest stage}`` for the run's optimizer and
    dense Adam at the same layout; ``{"unavailable": reason}`` for a run the planner does not
    model (the plan only informs: the run goes on)."""
    names = [config.optimizer.kind] + (["adam"] if config.optimizer.kind != "adam" else [])
    try:
        return {name: plan_memory(plan_settings(config, world_size, seq_length, name)).total_per_gpu
                for name in names}
    except UserError as error:
        return {"unavailable": str(error)}


def plan_line(planned: dict) -> str:
    if "unavailable" in planned:
        return f"memory plan: not available ({planned['unavailable']})"
    return "memory plan per GPU (tools/plan_memory.py): " + ", ".join(
        f"{name} {value / MIB:.1f} MiB" for name, value in planned.items())
