"""ModelConfig -> Megatron ``TransformerConfig`` + GPT layer ``ModuleSpec`` -> ``GPTModel``.

The layer spec is Megatron's seam between how a layer is wired and which implementation fills
each slot: the local (pure megatron-core) spec by default, Transformer Engine's when it imports
on a CUDA machine. ``--attention-backend`` fills its ``core_attention`` slot (torch's SDPA, or
Megatron's unfused ``DotProductAttention``); LoGRA swaps its sketching linears in through this
same spec.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import get_attr_wrapped_model

from logra_megatron.models.config import ATTENTION_BACKENDS, ModelConfig, resolve_attention_backend
from logra_megatron.models.sdpa_attention import SDPAttention
from logra_megatron.models.sequence_parallel_norm import sequence_parallel_block_spec
from logra_megatron.platform import cuda_available, default_device


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (it needs CUDA)."""
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def transformer_config(
    model: ModelConfig,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    recompute_granularity: Optional[str] = None,
    recompute_method: Optional[str] = None,
    recompute_num_layers: Optional[int] = None,
    sequence_parallel: bool = False,
    virtual_pipeline: Optional[int] = None,
):
    """The Megatron ``TransformerConfig`` for ``model`` at the given layout and precision.

    ``sequence_parallel``: Megatron's sequence parallelism (TP > 1): the activations outside the
    tensor-parallel linears are split along the sequence over TP. ``virtual_pipeline``: model
    chunks per pipeline rank (Megatron's interleaved schedule), None for one.

    ``recompute_*`` are Megatron's activation-recomputation fields (``None``: keep every
    activation); ``training/config.py: RecomputeConfig`` validates them and supplies them.

    Dropout is off (RL fine-tuning does not use it and it keeps runs deterministic). On CUDA,
    Megatron's fusions that need no Transformer Engine are on, as Megatron-LM runs by default:
    bias + SwiGLU and bias + dropout + add (torch.jit kernels), and the gradient-accumulation
    fusion where Apex's ``fused_weight_gradient_mlp_cuda`` is installed; the masked-softmax
    fusion (only the unfused attention uses it), rope and persistent layer-norm fusions need
    Apex or Transformer Engine kernels and stay off. On the CPU every fusion is off. On CUDA the parameters are created on the GPU
    (``use_cpu_initialization`` off, as Megatron-LM runs): Megatron's own draw is cheap there and
    is replaced anyway by the layout-independent one (``models/weights.py``), also drawn on the
    GPU. On the CPU the adapter needs ``use_cpu_initialization`` (Megatron's GPU path builds its
    tensors with ``device=torch.cuda.current_device()``).
    """

    on_cuda = cuda_available()
    return TransformerConfig(
        sequence_parallel=sequence_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        num_layers=model.layers,
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        num_query_groups=model.kv_heads,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=init_std,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_cuda,
        bias_activation_fusion=on_cuda,
        bias_dropout_fusion=on_cuda,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=on_cuda and _apex_wgrad_fusion_available(),
        deallocate_pipeline_outputs=on_cuda,
        # gloo (the CPU) pairs a batch of sends and receives between two ranks in the wrong order
        # when both directions go to one peer, as the interleaved schedule at PP = 2 does (the
        # first stage's next and previous rank are the same): single point-to-point calls there.
        batch_p2p_comm=on_cuda,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
    )


def _apex_wgrad_fusion_available() -> bool:
    """Apex's CUDA extension behind Megatron's gradient-accumulation fusion is importable."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (optional: built with Apex)
    except ImportError:
        return False
    return True


def gpt_layer_spec(use_transformer_engine: Optional[bool] = None, attention_backend: str = "auto"):
    """The GPT layer ``ModuleSpec``: Transformer Engine's when requested (default: when it
    imports), otherwise the local megatron-core spec with RMSNorm; its core attention per
    ``attention_backend`` (:func:`with_attention_backend`)."""

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec()
        # auto keeps Transformer Engine's own fused attention; a named backend replaces it.
        return spec if attention_backend == "auto" else with_attention_backend(spec, attention_backend)
    return with_attention_backend(get_gpt_layer_local_spec(normalization="RMSNorm"), attention_backend)


CORE_ATTENTION = {"sdpa": SDPAttention, "unfused": DotProductAttention}
"""The ``core_attention`` class of each resolved built-in ``--attention-backend`` (the registry,
``models/config.py: ATTENTION_BACKENDS``, names them by path; an outside one comes from there)."""


def with_attention_backend(spec, attention_backend: str = "auto"):
    """``spec`` (a GPT layer ``ModuleSpec``, changed in place and returned) with the core attention
    of ``attention_backend`` (``models/config.py: ATTENTION_BACKENDS``)."""
    attention = spec.submodules.self_attention.submodules
    resolved = resolve_attention_backend(attention_backend)
    attention.core_attention = CORE_ATTENTION.get(resolved) or ATTENTION_BACKENDS.get(resolved)
    return spec


def build_gpt_model(
    model: ModelConfig,
    config=None,
    layer_spec=None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
):
    """Build this rank's part of the model (its pipeline stage, its TP shard), on this process's
    device (its CUDA device, or the CPU), as Megatron-LM's ``get_model`` moves it right after
    building and before any wrapper (Float16Module, DDP) sees it.

    ``config`` defaults to :func:`transformer_config` at the current parallel layout;
    ``layer_spec`` to :func:`gpt_layer_spec`. The output logits stay vocab-parallel.
    """

    if config is None:
        config = transformer_config(
            model,
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    if layer_spec is None:
        layer_spec = gpt_layer_spec()
    if config.sequence_parallel and getattr(layer_spec, "module", None) is not TransformerBlock:
        layer_spec = sequence_parallel_block_spec(config, layer_spec, vp_stage)
    virtual = vp_stage is not None  # one model chunk of several on this pipeline rank
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=model.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=model.max_seq,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        vp_stage=vp_stage,
    )
    # Parameters Megatron builds on the CPU whatever the flag says (and every one of them under
    # use_cpu_initialization) move now; on the CPU this is a no-op.
    gpt.to(default_device())
    if config.params_dtype != torch.float32:
        # The local spec's norms create fp32 weights whatever params_dtype says; Megatron's
        # training casts every parameter to the compute dtype (Float16Module), and its
        # Float16Optimizer can only checkpoint the state of parameters of that dtype.
        with torch.no_grad():
            for param in gpt.parameters():
                param.data = param.data.to(config.params_dtype)
    return gpt


def causal_attention_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron's boolean attention mask for causal LM: shape [1, 1, s, s], True = masked."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0..s-1 for every row of a [batch, s] token tensor."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def model_device(model) -> torch.device:
    """The device ``model``'s parameters live on (every builder moves the whole model to one)."""
    return next(model.parameters()).device


def unwrap_model(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers (or ``model`` itself)."""

    return get_attr_wrapped_model(model, "decoder", return_model_obj=True)
