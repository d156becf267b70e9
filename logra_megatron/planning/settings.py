"""What a memory plan is computed from: plain data, no model built and no process group.

One :class:`PlanSettings` describes a job as its flags do (model, layout, precision, optimizer,
batch, activation recomputation, a KL reference model, a colocated rollout engine);
``logra_megatron/planning/state.py`` turns it into the training state each rank holds and
``logra_megatron/planning/activations.py`` into the step's transient peak.
"""

from dataclasses import dataclass, field, replace
from typing import Optional

from logra_megatron.engine_memory import KEEPS_ITS_OWN_WEIGHTS, EngineMemory
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models.config import ModelConfig, resolve_attention_backend
from logra_megatron.optim.dense_memory import DENSE_ROWS, MOMENT_DTYPES  # noqa: F401 (read from here)
from logra_megatron.ops.multiples import ceil_div, round_up

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")

DENSE_OPTIMIZERS = tuple(DENSE_ROWS)
"""Dense Adam as Megatron-Core 0.16.1 runs it, each row declaring its own bytes
(``optim/dense_memory.py``): plain (fp32 grads, masters, moments), precision-aware
(``use_precision_aware_optimizer``), CPU offload (``optimizer_cpu_offload``) and block-wise 8-bit
moments."""
OPTIMIZERS = DENSE_OPTIMIZERS + ("logra",)
ROWS = DENSE_OPTIMIZERS + ("adam-kl", "logra")
"""The planner's rows (``tools/plan_memory.py --optimizer``): the dense baselines a Megatron user
runs (no KL controller), ``adam-kl`` (dense Adam under our predicted-KL controller, with its fp32
copies of the mains), and LoGRA (under ``--kl-control``, as the trainer runs it)."""


@dataclass(frozen=True)
class RolloutPlan:
    """A rollout engine colocated with the trainer on the same GPUs: ``sequences_in_flight``
    sequences of ``max_tokens`` (prompt + response) tokens per data-parallel replica, in
    ``dtype_bytes`` per element; what that costs the engine says (``engine``, its declaration:
    engine_memory.py)."""

    sequences_in_flight: int = 0
    max_tokens: int = 0
    dtype_bytes: int = 2
    engine: EngineMemory = KEEPS_ITS_OWN_WEIGHTS
    """The engine's ``memory`` declaration (our embedded Megatron engine's holds no weights of its own)."""


@dataclass(frozen=True)
class PlanSettings:
    """One job, per the flags that decide its memory."""

    model: ModelConfig
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    virtual_pipeline: Optional[int] = None
    """Megatron's interleaved pipeline: model chunks per pipeline rank (its
    ``virtual_pipeline_model_parallel_size``, as the trainer's ``ParallelConfig.virtual_pipeline``
    resolves either flag); None: the plain 1F1B schedule. Pipeline rank ``r`` holds chunks
    ``r, r + PP, ..., r + (V - 1) PP`` of ``PP x V`` equal chunks; a "stage" of the plan is a rank."""
    optimizer: str = "logra"
    """``logra`` or one of :data:`DENSE_OPTIMIZERS` (``adam``: Megatron's dense Adam)."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (dense) / LoGRA's ZeRO-1 sharding of its state."""
    bf16: bool = False
    """bf16 weights (fp32 grads, fp32 masters for dense; LoGRA per ``logra.master``)."""
    logra: LogRAConfig = field(default_factory=LogRAConfig)
    kl_control: str = "probe"
    """``off``, ``probe`` or ``exact`` (what the predicted-KL controller holds during a step)."""
    kl_probe_sequences: int = 8
    exp_avg_dtype: str = "bf16"
    """``adam-precision-aware``: dtype of the first moment (:data:`MOMENT_DTYPES`)."""
    exp_avg_sq_dtype: str = "bf16"
    """``adam-precision-aware``: dtype of the second moment."""
    optimizer_offload_fraction: float = 1.0
    """``adam-cpu-offload``: the fraction of the optimizer's parameters whose state is on the host."""
    main_grads_dtype: str = "fp32"
    """``adam-cpu-offload``: Megatron's ``main_grads_dtype`` (with ``use_precision_aware_optimizer``,
    which slime's recipe sets beside the offload): the GPU gradient buffer in fp32 or bf16
    (``adam-precision-aware`` always plans bf16)."""
    micro_batch_size: int = 1
    """Rows per padded microbatch (the padded layout's ``b``; with packing, the KL probe's rows)."""
    pack_sequences: bool = False
    """The trainer's packed layout (``--no-pack-sequences`` off): a microbatch is one ``[1, t]``
    sequence of rows end to end (``cu_seqlens``, attention per row), ``t`` =
    :attr:`tokens_per_microbatch`; planned only where the trainer packs (SDPA attention:
    :attr:`packed`). False: ``micro_batch_size`` rows padded to ``seq_length``."""
    max_tokens_per_microbatch: int = 0
    """The packed layout's token budget (``--max-tokens-per-microbatch``, already resolved: the
    trainer's default is computed by its caller, ``rl/packing.py: default_token_budget``)."""
    global_batch_size: int = 1
    """Sequences per optimizer step over all data-parallel replicas."""
    seq_length: int = 2048
    recompute_granularity: str = "none"
    """Megatron's ``--recompute-granularity``: none, selective (core attention) or full."""
    recompute_method: Optional[str] = None
    """Megatron's ``--recompute-method`` for full recomputation: uniform or block."""
    recompute_num_layers: Optional[int] = None
    """Megatron's ``--recompute-num-layers``."""
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel`` (TP > 1): the activations outside the tensor-parallel
    regions (norms, residual stream, pipeline messages) are split along the sequence over the TP
    ranks (planning/activations.py says which tensor is which)."""
    overlap_grad_reduce: bool = False
    """Megatron's ``--overlap-grad-reduce``: the gradient buffer (and LoGRA's sketch buffer) cut
    into buckets of :attr:`bucket_size` elements, each reduced as the backward finishes it. The
    bytes change only by the padding of each bucket's end under the distributed optimizer."""
    ddp_bucket_size: Optional[int] = None
    """Megatron's ``--ddp-bucket-size`` (None: its default, see :attr:`bucket_size`)."""
    attention_backend: str = "auto"
    """``--attention-backend``: ``sdpa`` (``auto``) keeps no ``b x heads x s x s`` scores;
    ``unfused`` (Megatron's DotProductAttention) does."""
    reference_model: bool = False
    """A frozen copy of the initial policy for a KL penalty (weights only, ``dtype`` of the run)."""
    rollout: RolloutPlan = field(default_factory=RolloutPlan)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def bucket_size(self) -> Optional[int]:
        """Elements per gradient bucket as Megatron's DDP sets it (megatron-core 0.16.1
        ``distributed_data_parallel.py``): ``--ddp-bucket-size`` or ``max(4e7, 1e6 x DP)`` with
        ``--overlap-grad-reduce``, else None (one bucket). LoGRA's sketch buckets take the same."""
        if not self.overlap_grad_reduce:
            return None
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * self.data_parallel)

    @property
    def packed(self) -> bool:
        """Whether microbatches are packed: as the trainer decides (rl/trainer.py
        ``packing_options``), only with SDPA attention (Megatron's unfused attention takes no
        packed sequences)."""
        return self.pack_sequences and resolve_attention_backend(self.attention_backend) == "sdpa"

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens of the largest microbatch: packed, the budget, or one whole row where a row is
        longer (the trainer puts such a row alone in a microbatch); padded, ``b x s``."""
        if self.packed:
            tokens = max(self.max_tokens_per_microbatch, self.seq_length)
            # Under sequence parallelism the trainer pads each packed microbatch to a multiple
            # of TP (rl/grpo.py ``_packed_microbatches``).
            multiple = self.tensor_parallel if self.sequence_parallel else 1
            return round_up(tokens, multiple)
        return self.micro_batch_size * self.seq_length

    @property
    def num_microbatches(self) -> int:
        """Microbatches per DP replica and step: padded, rows over ``micro_batch_size``; packed,
        the replica's tokens (every row at ``seq_length``: the most a step can hold) over the
        budget, rounded up (rows are bin-packed whole: a full bin may fall short of it)."""
        if self.packed:
            per_replica = max(1, self.global_batch_size // self.data_parallel)
            return max(1, ceil_div(per_replica * self.seq_length, self.tokens_per_microbatch))
        return max(1, self.global_batch_size // (self.micro_batch_size * self.data_parallel))

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (1 without a virtual pipeline)."""
        return self.virtual_pipeline or 1

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches the schedule runs per step: under the interleaved schedule with several
        chunks at least PP (training/lm.py ``pipeline_pass`` fills a shorter pass with filler
        microbatches of zero loss), else :attr:`num_microbatches`."""
        if self.chunks > 1:
            return max(self.num_microbatches, self.pipeline_parallel)
        return self.num_microbatches

    @property
    def weight_bytes_per_element(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def dense(self) -> bool:
        return self.optimizer in DENSE_ROWS  # every declared row, those registered after import too

    def with_changes(self, **changes) -> "PlanSettings":
        return replace(self, **changes)


def settings_for_row(settings: PlanSettings, row: str) -> PlanSettings:
    """``settings`` for one of the planner's :data:`ROWS` (or a dense row registered since, in
    ``optim/dense_memory.py: DENSE_ROWS``): the dense baselines without the KL
    controller (as Megatron users run them; precision-aware Adam and CPU offload with the
    distributed optimizer, which Megatron requires for the first and the planner assumes for the
    second, as slime's recipe runs it), ``adam-kl`` dense Adam under the controller
    (``settings.kl_control``, or ``probe`` where that is off), LoGRA as ``settings`` say."""
    if row not in ROWS and row not in DENSE_ROWS:
        from logra_megatron.errors import UserError

        raise UserError(f"optimizer row must be one of {', '.join(ROWS)}, got {row!r}")
    if row == "logra":
        return replace(settings, optimizer="logra")
    if row == "adam-kl":
        return replace(settings, optimizer="adam",
                       kl_control="probe" if settings.kl_control == "off" else settings.kl_control)
    distributed = settings.distributed_optimizer or DENSE_ROWS.declared(row).info["needs_distributed"]
    return replace(settings, optimizer=row, kl_control="off", distributed_optimizer=distributed)
