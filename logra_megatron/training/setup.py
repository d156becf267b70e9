"""Build a trainable model + optimizer at the current layout: Megatron dense Adam, or LoGRA.

Shared by the smoke job, the benchmark and the RL trainer so the dense baseline and LoGRA are
built the same way apart from the layer spec and the optimizer.
"""

from typing import Optional

import torch

from logra_megatron.logra import LogRAConfig, LogRAOptimizer, logra_layer_spec
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.models import ModelConfig, build_gpt_model, gpt_layer_spec, transformer_config
from logra_megatron.models.weights import initialize_layout_independent

def build_trainable(model_config: ModelConfig, settings: OptimizerSettings,
                    logra_config: Optional[LogRAConfig] = None, dtype=torch.float32,
                    tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
                    seed: int = 1234):
    """Returns ``(model, ddp_model, optimizer)``: the bare model (for state and inspection), the
    Megatron DDP wrapper (to run), and the optimizer. The fresh weights are a function of
    ``seed`` alone, the same at every TP/PP layout."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tp = tensor_parallel or parallel_state.get_tensor_model_parallel_world_size()
    pp = pipeline_parallel or parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config(model_config, tp, pp, dtype=dtype)
    use_logra = settings.kind == "logra"
    spec = logra_layer_spec() if use_logra else gpt_layer_spec(use_transformer_engine=False)
    model = build_gpt_model(model_config, config, spec)
    initialize_layout_independent(model, model_config.vocab, seed)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=settings.distributed)
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=settings.distributed)
    if use_logra:
        logra_config = logra_config or LogRAConfig()
        if logra_config.zero1 != settings.distributed:
            from dataclasses import replace

            logra_config = replace(logra_config, zero1=settings.distributed)
        optimizer = LogRAOptimizer([ddp_model], optimizer_config, logra_config)
    else:
        optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
    return model, ddp_model, optimizer


def train_step(ddp_model, optimizer, run_forward_backward):
    """One optimizer step: clear grads/sketches, run forward/backward, step.

    ``run_forward_backward(ddp_model)`` returns the loss. Returns ``(loss, grad_norm)``.
    """
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run_forward_backward(ddp_model)
    _, grad_norm, _ = optimizer.step()
    return loss, grad_norm


def reset_optimizer_state(optimizer) -> None:
    """Start a new training phase with a clean optimizer: Adam moments and step counts dropped
    (LoGRA's sketched moments too), weights kept. The RL phase calls this after the supervised
    warm-up, whose second moments (scaled to supervised gradients, decaying over ~1000 steps)
    would otherwise set the size of the first few hundred RL updates."""
    from logra_megatron.logra.optimizer import LogRAOptimizer, reset_dense_state

    if isinstance(optimizer, LogRAOptimizer):
        optimizer.reset_state()
    else:
        reset_dense_state(optimizer)
