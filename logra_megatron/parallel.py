"""Process groups and the parallel layout.

One validated :class:`ParallelLayout` says how the world is split (tensor x pipeline x data
parallel); :func:`initialize` starts torch.distributed (from torchrun's environment, or as a
single process), builds Megatron's process groups for the layout and seeds Megatron's RNG
streams. The remaining functions are thin, named wrappers over ``parallel_state`` so the rest of
the project never reaches into Megatron's globals directly.
"""

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from logra_megatron.errors import UserError
from logra_megatron.platform import default_backend, setup_platform


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(timeout_minutes: int = 10) -> None:
    """Start torch.distributed from torchrun's environment, or as a 1-rank world.

    gloo on CPU, nccl on CUDA. Idempotent.
    """
    setup_platform()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend=default_backend(), timeout=timeout)
        return
    # A single process. The rendezvous address is passed explicitly rather than through
    # os.environ, so that child processes (tools, tests) do not inherit a port this one holds.
    dist.init_process_group(backend=default_backend(), timeout=timeout, rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")


def initialize(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234) -> ParallelLayout:
    """Start torch.distributed if needed, build Megatron's groups for the layout, seed RNGs.

    Re-initializing with another layout in the same process is allowed (tests use it): the
    previous model-parallel groups are destroyed first.
    """
    init_distributed()
    layout = ParallelLayout(tensor_parallel, pipeline_parallel, dist.get_world_size())
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return layout


def destroy() -> None:
    """Tear down Megatron's groups and torch.distributed (end of a program)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- thin wrappers over parallel_state -------------------------------------------------------

def tp_rank() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group():
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_group()


def pp_rank() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_world_size()


def pp_group():
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_group()


def dp_rank() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_world_size()


def dp_group():
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group()


def is_first_stage() -> bool:
    from megatron.core import parallel_state
    return parallel_state.is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    from megatron.core import parallel_state
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def last_stage_global_rank() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_last_rank()


def agree_on_scalar(value, op: str = "mean") -> float:
    """The same float on every rank: computed on the last pipeline stage, broadcast over the
    pipeline group, then averaged (``op="mean"``) or maxed over data-parallel replicas.

    Ranks that are not on the last stage pass any value (it is ignored).
    """
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    if pp_size() > 1:
        dist.broadcast(tensor, src=last_stage_global_rank(), group=pp_group())
    if dp_size() > 1:
        if op == "mean":
            dist.all_reduce(tensor, group=dp_group())
            tensor /= dp_size()
        elif op == "max":
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp_group())
        else:
            raise ValueError(f"unknown op {op!r}")
    return float(tensor.item())
