"""Process groups.

:func:`initialize` starts torch.distributed (from torchrun's environment, or as a single
process), builds Megatron's process groups for a validated
:class:`~logra_megatron.layout.ParallelLayout` and seeds Megatron's RNG streams. The remaining
functions are thin, named wrappers over ``parallel_state`` so the rest of the project never
reaches into Megatron's globals directly, and the two collectives every stage-spanning result
needs: a broadcast from the last pipeline stage, and :func:`agree_on_scalar`.
"""

import datetime
import os
import socket

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from logra_megatron.layout import ParallelLayout
from logra_megatron.platform import default_backend, default_device, setup_platform


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _restart_store(timeout):
    """None (torchrun's own rendezvous), except in a job torchrun restarted (``--max-restarts``)
    that shares its agent's store: there the first attempt's keys are still in the store, and a
    gloo rank reads a dead peer's address from them (measured: "connectFullMesh failed ...
    Connection refused" on every restart). A prefix per attempt keeps the attempts apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"logra_megatron/attempt_{attempt}", store)


def init_distributed(timeout_minutes: int = 10) -> None:
    """Start torch.distributed from torchrun's environment, or as a 1-rank world.

    gloo on CPU, nccl on CUDA. Idempotent.
    """
    setup_platform()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # launched by torchrun
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend=default_backend(), timeout=timeout)
        else:
            dist.init_process_group(backend=default_backend(), timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        return
    # A single process. The rendezvous address is passed explicitly rather than through
    # os.environ, so that child processes (tools, tests) do not inherit a port this one holds.
    dist.init_process_group(backend=default_backend(), timeout=timeout, rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")


def initialize(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234,
               virtual_pipeline: Optional[int] = None) -> ParallelLayout:
    """Start torch.distributed if needed, build Megatron's groups for the layout, seed RNGs.
    ``virtual_pipeline``: model chunks per pipeline rank (Megatron's interleaved schedule).

    Re-initializing with another layout in the same process is allowed (tests use it): the
    previous model-parallel groups are destroyed first.
    """
    init_distributed()
    layout = ParallelLayout(tensor_parallel, pipeline_parallel, dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() == 1 and _current_layout() == (tensor_parallel, pipeline_parallel, virtual_pipeline):
            # One rank, the same layout: keep its groups. Each fresh set is ~50 gloo threads that
            # never end and poll while idle (30 re-initializations: 1,544 threads burning 0.43 of
            # a core, measured), and in-process tests keep models that use the old groups.
            _seed(seed)
            return layout
        parallel_state.destroy_model_parallel()
        if dist.get_world_size() > 1:  # (one rank: in-process tests keep old models)
            _destroy_subgroups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
    )
    _seed(seed)
    return layout


def _current_layout() -> tuple:
    """``(TP, PP, virtual pipeline size)`` of the groups Megatron holds now."""
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size())


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _destroy_subgroups() -> None:
    """Megatron's ``destroy_model_parallel`` drops its groups without destroying them, and every
    gloo group keeps two threads and its sockets. A process that initializes many layouts (the
    multi-layout test workers) piled up ~500 groups and ~1,500 threads per rank, measured;
    destroy all but the default group before the next layout builds its own."""
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


def destroy() -> None:
    """Tear down Megatron's groups and torch.distributed (end of a program)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- thin wrappers over parallel_state -------------------------------------------------------

def tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def pp_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return parallel_state.get_pipeline_model_parallel_world_size()


def pp_group():
    return parallel_state.get_pipeline_model_parallel_group()


def dp_rank() -> int:
    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    return parallel_state.get_data_parallel_world_size()


def dp_group():
    return parallel_state.get_data_parallel_group()


def is_first_stage() -> bool:
    return parallel_state.is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def last_stage_global_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_last_rank()


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place; returned for
    convenience). Other stages pass a buffer of the same shape and dtype."""
    if pp_size() > 1:
        dist.broadcast(tensor, src=last_stage_global_rank(), group=pp_group())
    return tensor


def broadcast_object_from_last_stage(value):
    """A picklable ``value`` as the last pipeline stage holds it, on every stage."""
    if pp_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=last_stage_global_rank(), group=pp_group())
    return holder[0]


def replica_group():
    """The replica's model-parallel (TP x PP) group, or None in a one-rank replica (or before
    Megatron's groups exist)."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def is_replica_lead() -> bool:
    """Whether this is the replica's first rank (its lowest global rank: tensor rank 0 of the first
    pipeline stage), the one rank that talks to a rollout engine for the whole replica."""
    group = replica_group()
    return group is None or dist.get_rank(group) == 0


def from_replica_lead(value):
    """A picklable ``value`` as the replica's first rank holds it, on every rank of the replica."""
    group = replica_group()
    if group is None:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


def agree_on_scalar(value, op: str = "mean") -> float:
    """The same float on every rank: computed on the last pipeline stage, broadcast over the
    pipeline group, then averaged (``op="mean"``) or maxed over data-parallel replicas.

    Ranks that are not on the last stage pass any value (it is ignored).
    """
    # On the process's device: NCCL broadcasts and reduces device tensors only.
    tensor = broadcast_from_last_stage(torch.tensor([float(value)], dtype=torch.float64, device=default_device()))
    if dp_size() > 1:
        if op == "mean":
            dist.all_reduce(tensor, group=dp_group())
            tensor /= dp_size()
        elif op == "max":
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp_group())
        else:
            raise ValueError(f"unknown op {op!r}")
    return float(tensor.item())
