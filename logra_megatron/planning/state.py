"""The training state one rank holds, by component, from :class:`PlanSettings` alone.

No model is built and megatron-core is not imported: the shapes of a pipeline stage's
parameters are written down the way Megatron's GPTModel registers them (local layer spec), and
each component mirrors what the code allocates for them:

- **Placement.** Layers are split evenly over the pipeline. The first stage holds the word
  embedding, the last the final norm and the output layer; with tied embeddings at PP = 1 the
  output layer has no weight of its own, at PP > 1 the last stage keeps a full copy of the
  embedding (Megatron's ``shared_embedding`` parameter: its own gradient, master and moments).
  Under a virtual pipeline (V chunks per rank) rank ``r`` holds chunks ``r, r + PP, ...,
  r + (V - 1) PP`` of ``PP x V`` equal chunks, the embedding in rank 0's chunk 0, the final norm
  and output layer in rank PP - 1's last chunk; each chunk has its own DDP and so its own dense
  buffer (padded on its own, bucketed only for chunk 0), LoGRA one sketch buffer over them all.
- **TP shards.** Column-parallel weights (linear_qkv, linear_fc1 with its two SwiGLU halves, the
  output layer) split their output rows, row-parallel ones (linear_proj, linear_fc2) their input
  columns, the vocabulary (padded by :meth:`ModelConfig.padded_vocab`) is split in blocks, norms
  are replicated, the QKV bias is split with its rows.
- **Dense parameters** (all of them for ``adam``, the unsketched remainder for ``logra``) live in
  Megatron DDP's buffers: an fp32 gradient buffer (``grad_reduce_in_fp32``); with the
  distributed optimizer each parameter starts at a multiple of 64 elements, a bucket ends at a
  multiple of lcm(DP, 128), a ``shared_embedding`` parameter gets a bucket of its own, and the
  weights move into a parameter buffer of the same padded length. Megatron's optimizer keeps
  fp32 masters of bf16 parameters and two fp32 Adam moments plus torch's 4-byte ``step`` per
  tensor; with the distributed optimizer only for this DP rank's equal slice of every bucket
  (6 + 12/d bytes per parameter in bf16 instead of 18).
- **Sketched weights** (LoGRA) have no gradient buffer: one flat fp32 sketch buffer (padded to a
  multiple of DP in ZeRO-1 mode) and the norm probes' samples (``sketch_bytes``), the probes'
  directions (``norm_probe_bytes``), the update rule's state (``moment_bytes``: what the rule
  declares, logra/update_rules.py: two fp32 moments per element of this DP rank's slice for
  sketch-space Adam, one per sketch line for RowAdam; no norm probes for a rule that redraws its
  projections), fp32 projections, and per ``--logra-master`` fp32 masters of
  the weights (rows split over DP in ZeRO-1 mode) or none.
- **Dense baselines** (``settings.optimizer``; byte counts read from megatron-core 0.16.1's
  ``megatron/core/optimizer/``, see :func:`dense_optimizer_bytes`): ``adam`` as above;
  ``adam-precision-aware`` (``optimizer_config.py: use_precision_aware_optimizer``, distributed
  optimizer required): a bf16 gradient buffer (``main_grads_dtype``), 16-bit master remainders
  (``store_param_remainders``: ``distrib_optimizer.py`` allocates ``master_param`` as int16) and
  moments in ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (bf16, or fp8), TE FusedAdam's step in its
  param group (0 bytes); ``adam-cpu-offload`` (``optimizer_cpu_offload``,
  ``optimizer_offload_fraction``; ``cpu_offloading/hybrid_optimizer.py``): whole parameter shards,
  in order, until the fraction is reached, get an fp32 host copy (the master), pinned fp32 host
  gradients and torch Adam's moments and step on the HOST; the GPU keeps the weights, the fp32
  gradient buffer and, for the rest, fp32 masters and moments; ``adam-8bit``: Megatron's fp32
  gradients and masters with block-wise 8-bit moments (bitsandbytes' / torchao's: one byte per
  element and an fp32 absmax per block of 256, tensors under 4096 elements kept in fp32).
  Host bytes are per rank (:func:`stage_host_state`).
- **KL controller** (``--kl-control`` not off): while a step is proposed the dense optimizer keeps
  fp32 copies of its mains before and after the step (``controller_extra_bytes``; transient,
  inside the step's peak).
- **Reference model** (a KL penalty's frozen policy): this stage's weights in the run's dtype.
- **Rollout engine** colocated on the same GPUs: its weights (when it holds its own copy) and
  the KV cache of this stage's layers for the sequences in flight on this DP replica.

Counts are per rank; DP ranks differ only by the distributed optimizer's padding, so
:func:`stage_state` takes a DP rank and :func:`worst_dp_rank_state` returns the largest.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from logra_megatron.errors import UserError
from logra_megatron.layout import ParallelLayout
from logra_megatron.logra import update_memory
from logra_megatron.logra.buckets import bucket_layout
from logra_megatron.logra.sketch_memory import FP32, LEFT, RIGHT, SketchedWeight
from logra_megatron.models.config import resolve_attention_backend
from logra_megatron.ops.multiples import round_up
from logra_megatron.optim.dense_memory import (  # noqa: F401 (the components' names, read from here)
    ADAM_STEP_BYTES, BLOCKWISE_8BIT_BLOCK, BLOCKWISE_8BIT_MIN_NUMEL, DENSE_ROWS, HOST_COMPONENTS,
    proposal_copies_bytes)
from logra_megatron.planning.settings import (MOMENT_DTYPES, OPTIMIZERS, RECOMPUTE_GRANULARITIES,
                                              RECOMPUTE_METHODS, PlanSettings)
from logra_megatron.training.config import KL_MODES
from logra_megatron.training.measure import COMPONENTS as MEASURED_COMPONENTS

PARAM_ALIGNMENT = 64
"""Megatron DDP (distributed optimizer): every parameter starts at a multiple of 64 elements."""
BUCKET_ALIGNMENT = 128
"""... and every bucket ends at a multiple of lcm(DP, 128) elements."""

STATE_COMPONENTS = (*MEASURED_COMPONENTS, "norm_probe_bytes", "reference_model_bytes", "rollout_bytes")
"""The components a step measures on live tensors (training/measure.py names them), plus the norm
probes' directions, a reference model and a colocated rollout engine."""
TRANSIENT_COMPONENTS = ("controller_extra_bytes",)
"""Held only during a step (inside its peak, see logra_megatron/planning/plan.py)."""


@dataclass(frozen=True)
class Parameter:
    """One parameter of a pipeline stage as this rank holds it."""

    name: str
    """Global name, e.g. ``decoder.layers.3.mlp.linear_fc1.weight``."""
    shape: Tuple[int, ...]
    """This rank's shard."""
    sketch_side: Optional[str] = None
    """``"right"``/``"left"`` when LoGRA sketches it (then it has no dense gradient)."""
    shared_embedding: bool = False
    """Megatron's tied embedding under PP > 1 (first stage's or the last stage's copy)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def projected_dim(self) -> int:
        """The sketch's projected (never TP-split) dimension: in-features of a right sketch,
        out-features of a left one."""
        return SketchedWeight(self.sketch_side, *self.shape, rank=0).projected_dim


def check_settings(settings: PlanSettings) -> None:
    """Raise a :class:`UserError` when the settings describe a job that cannot run."""
    model = settings.model
    if settings.optimizer != "logra" and settings.optimizer not in DENSE_ROWS:
        raise UserError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {settings.optimizer!r}")
    row = DENSE_ROWS.declared(settings.optimizer)
    if row is not None and not row.info["controller"] and settings.kl_control != "off":
        raise UserError(f"{settings.optimizer} is planned without the KL controller (the planner's adam-kl row "
                        f"is dense Adam under it); got --kl-control {settings.kl_control}")
    if row is not None and row.info["needs_distributed"] and not settings.distributed_optimizer:
        raise UserError(f"{settings.optimizer} runs with Megatron's distributed optimizer")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(settings, name) not in MOMENT_DTYPES:
            raise UserError(f"--{name.replace('_', '-')} must be one of {', '.join(MOMENT_DTYPES)}, "
                            f"got {getattr(settings, name)!r}")
    if settings.main_grads_dtype not in ("fp32", "bf16"):
        raise UserError(f"--main-grads-dtype must be fp32 or bf16, got {settings.main_grads_dtype!r}")
    if not 0.0 <= settings.optimizer_offload_fraction <= 1.0:
        raise UserError(f"--optimizer-offload-fraction must be in [0, 1], got {settings.optimizer_offload_fraction}")
    ParallelLayout(settings.tensor_parallel, settings.pipeline_parallel, settings.world_size).check_model(
        model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab)
    check_virtual_pipeline(settings)
    if settings.data_parallel < 1:
        raise UserError(f"data-parallel size must be >= 1, got {settings.data_parallel}")
    if settings.kl_control not in KL_MODES:
        raise UserError(f"--kl-control must be one of {', '.join(KL_MODES)}, got {settings.kl_control!r}")
    if settings.micro_batch_size < 1 or settings.seq_length < 1:
        raise UserError("--micro-batch-size and --seq-length must be >= 1")
    if settings.sequence_parallel and settings.tensor_parallel < 2:
        raise UserError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                        "over the tensor-parallel ranks)")
    if settings.sequence_parallel and settings.optimizer == "logra" and settings.logra.embeddings:
        # logra/embeddings.py: the sketched embedding refuses Megatron's reduce-scatter of its output
        raise UserError("--logra-embeddings does not run under --sequence-parallel (the sketched embedding "
                        "takes no sequence-parallel output); drop one of them")
    if settings.sequence_parallel and not settings.packed and settings.seq_length % settings.tensor_parallel:
        raise UserError(f"--sequence-parallel splits the sequence over TP: --seq-length {settings.seq_length} "
                        f"must be divisible by --tensor-model-parallel-size {settings.tensor_parallel}")
    if settings.pack_sequences and settings.max_tokens_per_microbatch < 1:
        raise UserError(f"packed sequences need a token budget >= 1 (--max-tokens-per-microbatch), got "
                        f"{settings.max_tokens_per_microbatch}")
    per_step = settings.micro_batch_size * settings.data_parallel
    if settings.global_batch_size < per_step or settings.global_batch_size % per_step:
        raise UserError(
            f"--global-batch-size {settings.global_batch_size} must be a multiple of --micro-batch-size "
            f"{settings.micro_batch_size} x data-parallel size {settings.data_parallel}")
    if settings.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise UserError(f"--recompute-granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, "
                        f"got {settings.recompute_granularity!r}")
    if settings.recompute_method is not None and settings.recompute_method not in RECOMPUTE_METHODS:
        raise UserError(f"--recompute-method must be one of {', '.join(RECOMPUTE_METHODS)}, "
                        f"got {settings.recompute_method!r}")
    resolve_attention_backend(settings.attention_backend)  # an unknown name is one UserError
    if settings.optimizer == "logra":
        settings.logra.check_model(model)
        if settings.logra.master == "bf16-sr" and not settings.bf16:
            raise UserError("--logra-master bf16-sr needs --bf16")
    rollout = settings.rollout
    if rollout.sequences_in_flight < 0 or rollout.max_tokens < 0 or rollout.dtype_bytes < 1:
        raise UserError("rollout sequences, tokens and dtype bytes must be >= 0")


def chunk_layers(settings: PlanSettings, stage: int, chunk: int) -> range:
    """Global indices of the transformer layers of model chunk ``chunk`` on pipeline rank
    ``stage``: virtual stage ``chunk x PP + stage`` of ``PP x V`` equal chunks (Megatron's
    interleaved placement; one chunk, the stage's even share, without a virtual pipeline)."""
    per_chunk = settings.model.layers // (settings.pipeline_parallel * settings.chunks)
    virtual = chunk * settings.pipeline_parallel + stage
    return range(virtual * per_chunk, (virtual + 1) * per_chunk)


def check_virtual_pipeline(settings: PlanSettings) -> None:
    """The resolved chunk count (the flags themselves are checked by the trainer's
    ``ParallelConfig``, which tools/plan_memory.py reuses): chunks of whole layers, PP > 1."""
    chunks = settings.virtual_pipeline
    if chunks is None:
        return
    per_stage = settings.model.layers // settings.pipeline_parallel
    if chunks < 1 or settings.pipeline_parallel < 2 or per_stage % chunks:
        raise UserError(f"a virtual pipeline of {chunks} chunks per rank needs PP > 1 and chunks of whole layers "
                        f"({per_stage} per stage at PP {settings.pipeline_parallel})")


def stage_layers(settings: PlanSettings, stage: int) -> list:
    """Global indices of the transformer layers on pipeline rank ``stage``, chunk by chunk."""
    return [index for chunk in range(settings.chunks) for index in chunk_layers(settings, stage, chunk)]


def parameter_shapes(settings: PlanSettings, stage: int) -> List[Parameter]:
    """This rank's parameters, in the order Megatron's GPTModel registers them, chunk by chunk."""
    return [param for chunk in chunk_parameters(settings, stage) for param in chunk]


def chunk_parameters(settings: PlanSettings, stage: int) -> List[List[Parameter]]:
    """This rank's parameters per model chunk (one chunk without a virtual pipeline): the word
    embedding in the model's first chunk (rank 0, chunk 0), the final norm and the output layer
    in its last (rank PP - 1, chunk V - 1)."""
    pp = settings.pipeline_parallel
    if not 0 <= stage < pp:
        raise UserError(f"stage {stage} is outside 0..{pp - 1}")
    chunks = settings.chunks
    return [_chunk_parameters(settings, chunk_layers(settings, stage, chunk),
                              first=stage == 0 and chunk == 0, last=stage == pp - 1 and chunk == chunks - 1)
            for chunk in range(chunks)]


def _chunk_parameters(settings: PlanSettings, layers: range, first: bool, last: bool) -> List[Parameter]:
    model, tp, pp = settings.model, settings.tensor_parallel, settings.pipeline_parallel
    logra = settings.optimizer == "logra"
    embeddings_sketched = logra and settings.logra.embeddings
    linear_right, linear_left = (RIGHT, LEFT) if logra else (None, None)
    vocab_side = RIGHT if embeddings_sketched else None
    hidden, tied = model.hidden, model.tie_embeddings
    query = model.heads * model.kv_channels
    qkv_rows = (query + 2 * model.kv_heads * model.kv_channels) // tp
    vocab_rows = model.padded_vocab(tp) // tp
    params = []
    if first:
        params.append(Parameter("embedding.word_embeddings.weight", (vocab_rows, hidden), vocab_side,
                                shared_embedding=tied and pp > 1))
    for index in layers:
        prefix = f"decoder.layers.{index}."
        params.append(Parameter(prefix + "input_layernorm.weight", (hidden,)))
        params.append(Parameter(prefix + "self_attention.linear_proj.weight", (hidden, query // tp), linear_left))
        params.append(Parameter(prefix + "self_attention.linear_qkv.weight", (qkv_rows, hidden), linear_right))
        if model.qkv_bias:
            params.append(Parameter(prefix + "self_attention.linear_qkv.bias", (qkv_rows,)))
        params.append(Parameter(prefix + "pre_mlp_layernorm.weight", (hidden,)))
        params.append(Parameter(prefix + "mlp.linear_fc1.weight", (2 * model.ffn_hidden // tp, hidden), linear_right))
        params.append(Parameter(prefix + "mlp.linear_fc2.weight", (hidden, model.ffn_hidden // tp), linear_left))
    if last:
        params.append(Parameter("decoder.final_layernorm.weight", (hidden,)))
        if not (tied and pp == 1):  # tied at PP = 1: the output layer uses the embedding's weight
            params.append(Parameter("output_layer.weight", (vocab_rows, hidden), vocab_side,
                                    shared_embedding=tied))
    return params


@dataclass(frozen=True)
class DenseBuffer:
    """Megatron DDP's layout of the dense parameters: buffer length and its buckets, each as
    ``(start, end, [(parameter, start, end), ...])``."""

    numel: int
    buckets: Tuple[tuple, ...]

    def shard(self, dp: int, dp_rank: int) -> List[Tuple[Parameter, int]]:
        """``(parameter, elements)`` of every parameter intersecting this DP rank's slice of the
        buckets (the distributed optimizer's masters and moments exist only for these)."""
        owned = []
        for start, end, members in self.buckets:
            size = (end - start) // dp
            low, high = start + dp_rank * size, start + (dp_rank + 1) * size
            for param, first, stop in members:
                elements = min(stop, high) - max(first, low)
                if elements > 0:
                    owned.append((param, elements))
        return owned


def dense_buffer(params: List[Parameter], dp: int, distributed: bool,
                 bucket_size: Optional[int] = None) -> DenseBuffer:
    """Megatron's ``_ParamAndGradBuffer`` layout for ``params`` (one buffer: every dense parameter
    of a stage has the same dtype): parameters in reverse registration order; a bucket closed
    once it holds ``bucket_size`` elements (None: one bucket, as without
    ``--overlap-grad-reduce``); with the distributed optimizer, starts padded to 64 elements, a
    bucket end to lcm(DP, 128), and a shared embedding in a bucket of its own."""
    bucket_multiple = math.lcm(dp, BUCKET_ALIGNMENT)
    buckets, members, bucket_start, position = [], [], 0, 0

    def close(end: int) -> int:
        nonlocal members, bucket_start
        padded = round_up(end, bucket_multiple) if distributed else end
        buckets.append((bucket_start, padded, tuple(members)))
        members, bucket_start = [], padded
        return padded

    for param in reversed(params):
        if distributed:
            position = round_up(position, PARAM_ALIGNMENT)
        own_bucket = param.shared_embedding and distributed
        if own_bucket and members:
            position = close(position)
        members.append((param, position, position + param.numel))
        position += param.numel
        if own_bucket or (bucket_size is not None and position - bucket_start >= bucket_size):
            position = close(position)
    if members:
        position = close(position)
    return DenseBuffer(position, tuple(buckets))


def stage_bucket_size(settings: PlanSettings, stage: int) -> Optional[int]:
    """The dense buffer's bucket size on pipeline stage ``stage``: Megatron's DDP buckets only the
    first stage's buffer (``distributed_data_parallel.py``: later stages' reduction is off the
    critical path), the others are one bucket."""
    return settings.bucket_size if stage == 0 else None


def stage_dense_buffers(settings: PlanSettings, stage: int) -> List[DenseBuffer]:
    """The dense buffers of pipeline rank ``stage``: one per model chunk, as each chunk has its
    own DDP (training/setup.py ``build_trainable``, as Megatron-LM's ``get_model``), of which only
    the first is bucketed (``disable_bucketing`` for the others) and, as any, only on rank 0."""
    dp, distributed = settings.data_parallel, settings.distributed_optimizer
    return [dense_buffer([p for p in chunk if p.sketch_side is None], dp, distributed,
                         stage_bucket_size(settings, stage) if index == 0 else None)
            for index, chunk in enumerate(chunk_parameters(settings, stage))]


def sketch_buffer_numel(numels: List[int], shared_embedding: List[bool], dp: int,
                        bucket_size: Optional[int]) -> int:
    """Elements of LoGRA's flat sketch buffer as the buffer lays itself out (``logra/buckets.py``):
    buckets of ``bucket_size``, each padded to a multiple of ``dp`` under ZeRO-1 (``dp`` 1: none)."""
    return bucket_layout(numels, shared_embedding, bucket_size, dp, dp > 1)[2]


def sketch_rank(settings: PlanSettings, param: Parameter) -> int:
    """The LoGRA rank of a sketched weight (logra/config.py: ``sketch_rank``)."""
    return settings.logra.sketch_rank(param.projected_dim, param.name)


def sketched_weight(settings: PlanSettings, param: Parameter) -> SketchedWeight:
    """What LoGRA holds for a sketched weight, as LoGRA declares it (logra/sketch_memory.py)."""
    return SketchedWeight(param.sketch_side, *param.shape, rank=sketch_rank(settings, param))


def update_rule(settings: PlanSettings):
    """What ``--logra-update``'s rule declares of its memory (logra/update_memory.py: a torch-free
    class for the package's rules, the rule class itself for an outside one)."""
    return update_memory.declared_memory(settings.logra.update)


def norm_probes(settings: PlanSettings) -> int:
    """Norm probes per sketched weight: none with the identity projection (the sketch is the
    gradient) or for a rule that declares it does without them."""
    logra = settings.logra
    if logra.identity_projection or not update_memory.uses_norm_probes(update_rule(settings)):
        return 0
    return logra.norm_probes


def update_rule_state_bytes(settings: PlanSettings, slice_numel: int, line_numel: int) -> int:
    """The update rule's state on one rank, as the rule declares it."""
    return update_memory.state_bytes(update_rule(settings), slice_numel, line_numel)


def update_rule_temporaries(settings: PlanSettings, slice_numel: int, line_numel: int) -> Tuple[int, int]:
    """``(peak, held)`` bytes of the update rule's step besides ``U``, as the rule declares them."""
    return update_memory.update_temporaries(update_rule(settings), slice_numel, line_numel)


def sketch_lines(settings: PlanSettings, stage: int) -> int:
    """Lines of every sketch of the stage (the length of a per-line state, never sliced)."""
    return sum(sketched_weight(settings, p).lines
               for p in parameter_shapes(settings, stage) if p.sketch_side is not None)


def dense_main_numel(settings: PlanSettings, stage: int, dp_rank: Optional[int] = None) -> int:
    """Elements of the fp32 mains Megatron's optimizer updates on this rank (masters of bf16
    parameters, or the fp32 parameters themselves; this DP rank's shard under the distributed
    optimizer); ``dp_rank`` None: the largest over DP ranks."""
    dense = [p for p in parameter_shapes(settings, stage) if p.sketch_side is None]
    if not settings.distributed_optimizer:
        return sum(p.numel for p in dense)
    buffers = stage_dense_buffers(settings, stage)
    ranks = range(settings.data_parallel) if dp_rank is None else [dp_rank]
    return max(sum(n for buffer in buffers for _, n in buffer.shard(settings.data_parallel, r)) for r in ranks)


def stage_state(settings: PlanSettings, stage: int, dp_rank: int = 0, with_host: bool = False):
    """Bytes of every component in :data:`STATE_COMPONENTS` on the GPU of the rank of pipeline
    stage ``stage`` and data-parallel rank ``dp_rank`` (every TP rank holds the same);
    ``with_host``: ``(gpu, host)``, host by :data:`HOST_COMPONENTS`."""
    check_settings(settings)
    dp, distributed = settings.data_parallel, settings.distributed_optimizer
    if not 0 <= dp_rank < dp:
        raise UserError(f"data-parallel rank {dp_rank} is outside 0..{dp - 1}")
    weight_element = settings.weight_bytes_per_element
    params = parameter_shapes(settings, stage)
    dense = [p for p in params if p.sketch_side is None]
    sketched = [p for p in params if p.sketch_side is not None]
    buffers = stage_dense_buffers(settings, stage)
    buffer_numel = sum(buffer.numel for buffer in buffers)

    # Dense parameters: Megatron DDP (one per model chunk) + Megatron's optimizer.
    if distributed:
        mains = [owned for buffer in buffers for owned in buffer.shard(dp, dp_rank)]
        dense_weights = buffer_numel * weight_element  # moved into DDP's padded parameter buffers
    else:
        mains = [(p, p.numel) for p in dense]
        dense_weights = sum(p.numel for p in dense) * weight_element
    main_numel = sum(n for _, n in mains)
    state = dict.fromkeys(STATE_COMPONENTS, 0)
    state["weight_bytes"] = dense_weights + sum(p.numel for p in sketched) * weight_element
    gpu, host = dense_optimizer_bytes(settings, buffer_numel if dense else 0, mains)
    state.update(gpu)
    if settings.kl_control != "off":
        state["controller_extra_bytes"] = proposal_copies_bytes(main_numel)

    # Sketched weights: LoGRA's sketch buffer, probes, sketch-space Adam, projections, masters.
    if sketched:
        logra = settings.logra
        zero1 = distributed
        weights = [sketched_weight(settings, p) for p in sketched]
        flat = sketch_buffer_numel([w.sketch_numel for w in weights],
                                   [p.shared_embedding for p in sketched], dp if zero1 else 1, settings.bucket_size)
        probes = norm_probes(settings)
        state["sketch_bytes"] = (flat + sum(w.probe_sample_numel(probes) for w in weights)) * FP32
        state["norm_probe_bytes"] = sum(w.probe_direction_numel(probes) for w in weights) * FP32
        # The rule's state, per element of this rank's slice or per line: the rule says which and how much.
        state["moment_bytes"] += update_rule_state_bytes(settings, flat // dp if zero1 else flat,
                                                         sum(w.lines for w in weights))
        state["projection_bytes"] = sum(w.projection_numel for w in weights) * FP32
        if settings.bf16 and logra.master == "fp32":
            parts, part = (dp, dp_rank) if zero1 and dp > 1 else (1, 0)
            state["master_bytes"] += FP32 * sum(w.master_numel(parts, part) for w in weights)

    # Beside training: a frozen reference policy and a colocated rollout engine.
    stage_numel = sum(p.numel for p in params)
    if settings.reference_model:
        state["reference_model_bytes"] = stage_numel * weight_element
    state["rollout_bytes"] = rollout_bytes(settings, stage)
    return (state, host) if with_host else state


def stage_host_state(settings: PlanSettings, stage: int, dp_rank: int = 0) -> Dict[str, int]:
    """Host bytes of every component in :data:`HOST_COMPONENTS` on the rank of ``stage`` and
    ``dp_rank`` (all zero but for ``adam-cpu-offload``)."""
    return stage_state(settings, stage, dp_rank, with_host=True)[1]


def dense_optimizer_bytes(settings: PlanSettings, grad_buffer_numel: int,
                          mains: List[Tuple[Parameter, int]]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """``(gpu, host)``: the dense optimizer's gradient buffer, masters and moments on one rank, as
    the row ``settings.optimizer`` declares them (``optim/dense_memory.py``; LoGRA's dense remainder
    is Megatron's Adam); ``mains`` are the ``(parameter, elements)`` the optimizer updates on this
    rank (its shard under the distributed optimizer)."""
    row = DENSE_ROWS.get("adam" if settings.optimizer == "logra" else settings.optimizer)
    return row(settings, grad_buffer_numel, [elements for _, elements in mains])


def rollout_bytes(settings: PlanSettings, stage: int) -> int:
    """A colocated rollout engine on this rank, as the engine declares it (``RolloutPlan.engine``,
    engine_memory.py): this rank's layers and KV heads, and its weights should it keep a copy."""
    model, rollout = settings.model, settings.rollout
    return rollout.engine.bytes(layers=len(stage_layers(settings, stage)),
                                kv_heads=model.kv_heads // settings.tensor_parallel, kv_channels=model.kv_channels,
                                sequences=rollout.sequences_in_flight, max_tokens=rollout.max_tokens,
                                model_max_tokens=model.max_seq, dtype_bytes=rollout.dtype_bytes,
                                weight_numel=sum(p.numel for p in parameter_shapes(settings, stage)))


def worst_dp_rank_state(settings: PlanSettings, stage: int) -> Tuple[int, Dict[str, int]]:
    """``(dp_rank, components)`` of the DP rank of ``stage`` that holds the most state (ranks
    differ only by the distributed optimizer's padding; without it every rank is the same)."""
    ranks = range(settings.data_parallel) if settings.distributed_optimizer else [0]
    best = None
    for rank in ranks:
        state = stage_state(settings, stage, rank)
        if best is None or sum(state.values()) > sum(best[1].values()):
            best = (rank, state)
    return best


def refresh_step_bytes(settings: PlanSettings, stage: int) -> int:
    """Extra fp32 bytes live through the backward of a LoGRA refresh step (logra/refresh.py):
    per sketched weight a Gaussian test matrix (the non-projected side x (rank + oversampling))
    and the range sample (projected side x the same columns)."""
    total = 0
    if settings.logra.identity_projection or not update_memory.uses_range_finder(update_rule(settings)):
        return 0  # never refreshed, or a rule that redraws its projections without a range finder
    for param in parameter_shapes(settings, stage):
        if param.sketch_side is not None:
            total += sketched_weight(settings, param).refresh_numel(settings.logra.oversampling) * FP32
    return total


def proposal_update_bytes(settings: PlanSettings, stage: int) -> int:
    """Bytes of LoGRA's proposed low-rank update ``U`` (one full-length flat fp32 tensor laid out
    like the sketch buffer, held from propose to commit; logra/optimizer.py)."""
    sketched = [p for p in parameter_shapes(settings, stage) if p.sketch_side is not None]
    numel = sketch_buffer_numel([sketched_weight(settings, p).sketch_numel for p in sketched],
                                [p.shared_embedding for p in sketched],
                                settings.data_parallel if settings.distributed_optimizer else 1, settings.bucket_size)
    return numel * FP32
