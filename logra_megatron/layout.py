"""The parallel layout: how the world's ranks are split, validated before any process group
starts (plain data; no torch.distributed, no megatron-core)."""

from dataclasses import dataclass

from logra_megatron.errors import UserError


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks are split. Validated on construction.

    Megatron orders ranks tensor-parallel fastest, then data-parallel, then pipeline.
    """

    tensor_parallel: int = 1
    """Ranks that split every linear layer (heads and FFN columns/rows)."""
    pipeline_parallel: int = 1
    """Pipeline stages; the transformer layers are divided evenly among them."""
    world_size: int = 1
    """Total ranks; the data-parallel size is what remains: world / (tp * pp)."""

    def __post_init__(self):
        for name in ("tensor_parallel", "pipeline_parallel", "world_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} size must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel != 0:
            raise UserError(
                f"world size {self.world_size} is not divisible by tensor-parallel "
                f"{self.tensor_parallel} x pipeline-parallel {self.pipeline_parallel} = "
                f"{model_parallel}; launch a multiple of {model_parallel} ranks or lower TP/PP"
            )

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int, ffn_hidden: int,
                    vocab_size: int, model_name: str = "model") -> None:
        """Raise a :class:`UserError` if this layout cannot split the model."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        for what, value in (("attention heads", num_heads), ("kv heads", num_kv_heads),
                            ("ffn hidden size", ffn_hidden)):
            if value % tp != 0:
                raise UserError(
                    f"{model_name} has {value} {what}, not divisible by tensor-parallel size "
                    f"{tp}; choose a tensor-parallel size that divides {value}"
                )
        if num_layers % pp != 0:
            raise UserError(
                f"{model_name} has {num_layers} layers, not divisible by pipeline-parallel size "
                f"{pp}; choose a pipeline-parallel size that divides {num_layers}"
            )
        if vocab_size < tp:
            raise UserError(f"vocab size {vocab_size} is smaller than tensor-parallel size {tp}")


def microbatch_group_size(num_microbatches: int, pipeline: int) -> int:
    """The contiguous microbatches per virtual stage for Megatron's interleaved schedule
    (``microbatch_group_size_per_vp_stage``, default the pipeline size), as the trainer sets it
    (training/lm.py) and the planner replays it (planning/activations.py): megatron-core 0.16.1
    (pipeline_parallel/schedules.py) wants it in [PP, M] and the remainder ``M % N`` 0 or at
    least PP. The smallest such ``N`` (a larger one keeps more activations in flight); M = PP
    gives PP, any M >= PP has one (N = M)."""
    for size in range(pipeline, num_microbatches + 1):
        remainder = num_microbatches % size
        if remainder == 0 or remainder >= pipeline:
            return size
    raise ValueError(f"{num_microbatches} microbatches are fewer than the pipeline's {pipeline} stages")
