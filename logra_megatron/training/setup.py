"""Build a trainable model + optimizer at the current layout: Megatron dense Adam, or LoGRA.

Shared by the smoke job, the benchmark and the RL trainer so the dense baseline and LoGRA are
built the same way apart from the layer spec and the optimizer (from the registry in
:mod:`logra_megatron.training.optimizer`).
"""

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig

from logra_megatron.logra import LogRAConfig, logra_layer_spec
from logra_megatron.logra.embeddings import sketch_embeddings
from logra_megatron.models import ModelConfig, build_gpt_model, gpt_layer_spec, transformer_config
from logra_megatron.models.weights import initialize_layout_independent
from logra_megatron.training.config import OptimizerSettings, RecomputeConfig
from logra_megatron.training.optimizer import TrainingOptimizer, build_optimizer


def build_trainable(model_config: ModelConfig, settings: OptimizerSettings,
                    logra_config: Optional[LogRAConfig] = None, dtype=torch.float32,
                    tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
                    seed: int = 1234, recompute: Optional[RecomputeConfig] = None,
                    attention_backend: str = "auto", sequence_parallel: bool = False,
                    overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                    ddp_bucket_size: Optional[int] = None, optimizer_overrides: Optional[dict] = None):
    """Returns ``(model, ddp_model, optimizer)``: the bare model (for state and inspection), the
    Megatron DDP wrapper (to run), and the optimizer (a Megatron-Core ``ChainedOptimizer``,
    :class:`~logra_megatron.optim.controlled.ControlledOptimizer`). The fresh weights are a
    function of ``seed`` alone, the same at every TP/PP layout. ``recompute``: activation
    recomputation in the backward (default: none). ``attention_backend``: the layers' core
    attention (``--attention-backend``: auto, sdpa or unfused). ``sequence_parallel`` and
    ``overlap_grad_reduce`` are Megatron's (the latter covers LoGRA's sketches too:
    ``logra/sketch_overlap.py``); ``overlap_param_gather`` is Megatron's too (with
    ``settings.distributed``): the distributed optimizer's all-gather of the updated dense weights
    runs bucket by bucket ahead of the next forward, not inside ``step()``; it concerns the dense
    remainder only, as sketched weights are updated in place on every rank and never gathered.
    ``ddp_bucket_size`` is Megatron's ``--ddp-bucket-size`` (None:
    its default). ``optimizer_overrides``: further ``OptimizerConfig`` fields (the benchmark's
    baseline rows: precision-aware Adam, CPU offload); a bf16 ``main_grads_dtype`` makes DDP reduce
    gradients in bf16. Under a virtual pipeline (process groups initialized with one)
    the model and its DDP wrapper are lists, one model chunk per virtual stage."""
    tp = tensor_parallel or parallel_state.get_tensor_model_parallel_world_size()
    pp = pipeline_parallel or parallel_state.get_pipeline_model_parallel_world_size()
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    recompute = recompute or RecomputeConfig()
    recompute.check_layers(model_config.layers // pp // (virtual or 1))
    config = transformer_config(model_config, tp, pp, dtype=dtype, sequence_parallel=sequence_parallel,
                                virtual_pipeline=virtual, **recompute.transformer_kwargs())
    if settings.sketched:
        spec = logra_layer_spec(attention_backend=attention_backend)
    else:
        spec = gpt_layer_spec(use_transformer_engine=False, attention_backend=attention_backend)
    overrides = dict(optimizer_overrides or {})
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=overrides.get("main_grads_dtype", torch.float32) == torch.float32,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        bucket_size=ddp_bucket_size, use_distributed_optimizer=settings.distributed)
    # One model chunk per virtual pipeline stage (Megatron's interleaved schedule, when the
    # process groups were initialized with one: parallel.initialize(virtual_pipeline=...)),
    # each in its own DDP; only the first chunk's buffers are bucketed, as Megatron-LM's get_model.
    models, ddp_models = [], []
    for index, vp_stage in enumerate(range(virtual) if virtual else [None]):
        model = build_gpt_model(model_config, config, spec, vp_stage=vp_stage)
        initialize_layout_independent(model, model_config.vocab, seed)
        if settings.sketched and logra_config is not None and logra_config.embeddings:
            sketch_embeddings(model, model_config.vocab)
        models.append(model)
        ddp_models.append(DistributedDataParallel(config, ddp_config, model, disable_bucketing=index > 0))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=settings.distributed, overlap_param_gather=overlap_param_gather, **overrides)
    optimizer = build_optimizer(settings.kind, optimizer_config, ddp_models, logra_config)
    if overlap_grad_reduce:
        # As Megatron-LM's train() does; read after the optimizer is built, whose sketch reduction
        # extends each chunk's no_sync.
        no_sync = [chunk.no_sync for chunk in ddp_models]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if overlap_param_gather:
        # As Megatron-LM's train() does: the schedule starts each chunk's parameter all-gather.
        param_sync = [chunk.start_param_sync for chunk in ddp_models]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    if virtual:
        return models, ddp_models, optimizer
    return models[0], ddp_models[0], optimizer


def gather_updated_weights(ddp_model) -> None:
    """Complete the dense weights' all-gather that ``--overlap-param-gather`` leaves to the next
    forward's pre-hooks (Megatron's DDP), for whatever reads the weights outside such a forward: a
    checkpoint save, a weight sync into another engine. Megatron-LM's ``training.py`` does the
    same before it saves or evaluates (``disable_forward_pre_hook``). A no-op without the flag."""
    for chunk in ddp_model if isinstance(ddp_model, list) else [ddp_model]:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def train_step(ddp_model, optimizer: TrainingOptimizer, run_forward_backward):
    """One optimizer step: clear grads/sketches, run forward/backward, step.

    ``run_forward_backward(ddp_model)`` returns the loss. Returns ``(loss, grad_norm)``.
    """
    for chunk in ddp_model if isinstance(ddp_model, list) else [ddp_model]:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run_forward_backward(ddp_model)
    _, grad_norm, _ = optimizer.step()
    return loss, grad_norm
