"""CommCounter on 2 gloo ranks: counts against hand counts of known collectives, torch's nested
and batched paths counted once, the functions restored after the block, and Megatron's own
pipeline send/receive (plain and batched) and tensor-parallel all-reduce seen by the counter."""

import torch
import torch.distributed as dist
from common import Checks

from logra_megatron import parallel
from logra_megatron.platform.comm_counter import CommCounter, group_kind
from logra_megatron.training.measure import rank_coordinates

FLOAT = 4


def records(counter):
    """``{"op ranks": [calls, bytes]}`` (JSON-able)."""
    return {f"{name} {','.join(map(str, ranks))}": [entry["calls"], entry["bytes"]]
            for (name, ranks), entry in counter.records.items()}


def main():
    checks = Checks()
    parallel.init_distributed()
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])

    def known_all_reduce():
        tensor = torch.full((3, 5), float(rank + 1))
        with CommCounter() as counter:
            dist.all_reduce(tensor, group=pair)
        return {"records": records(counter), "expected_bytes": tensor.numel() * tensor.element_size(),
                "value": float(tensor[0, 0])}

    def gathers_and_scatters():
        with CommCounter() as counter:
            out = torch.empty(8)
            dist.all_gather_into_tensor(out, torch.full((4,), float(rank)), group=pair)
            legacy = torch.empty(6)
            dist._all_gather_base(legacy, torch.full((3,), float(rank)), group=pair)  # -> all_gather_single
            shard = torch.empty(5)
            dist.reduce_scatter_tensor(shard, torch.ones(10), group=pair)
            parts = [torch.empty(2), torch.empty(2)]
            dist.all_gather(parts, torch.full((2,), float(rank)), group=pair)
        return {"records": records(counter), "gathered": out.tolist(), "shard": shard.tolist()}

    def batched_p2p():
        send, receive = torch.full((7,), float(rank)), torch.empty(7)
        peer = 1 - rank
        with CommCounter() as counter:
            ops = [dist.P2POp(dist.isend, send, peer, pair), dist.P2POp(dist.irecv, receive, peer, pair)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return {"records": records(counter), "received": receive.tolist()}

    def coalesced_all_reduce():
        # Megatron's grad buffers: several all-reduces inside torch's coalescing manager.
        first, second = torch.ones(6), torch.ones(10)
        with CommCounter() as counter:
            with dist._coalescing_manager(pair, async_ops=True) as manager:
                dist.all_reduce(first, group=pair, async_op=True)
                dist.all_reduce(second, group=pair, async_op=True)
            manager.wait()
        return {"records": records(counter), "sums": [float(first[0]), float(second[0])]}

    def object_collective_and_restore():
        originals = (dist.all_reduce, dist.distributed_c10d.all_reduce, dist.isend)
        holder = [{"rank": rank}] if rank == 0 else [None]
        with CommCounter() as counter:
            wrapped = dist.all_reduce is not originals[0]
            dist.broadcast_object_list(holder, src=0, group=pair)  # torch's inner broadcasts
        inside = counter.total_bytes()
        dist.all_reduce(torch.ones(3), group=pair)  # after the block: not counted
        return {"records": records(counter), "received": holder[0], "wrapped_inside": wrapped,
                "restored": (dist.all_reduce, dist.distributed_c10d.all_reduce, dist.isend) == originals,
                "grew_after_exit": counter.total_bytes() - inside}

    def megatron_pipeline_p2p():
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        parallel.initialize(1, 2)
        coordinates = rank_coordinates()
        found = {}
        for batched in (False, True):
            config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                         batch_p2p_comm=batched)
            communicator = P2PCommunicator(parallel.pp_group(), config)
            activation = torch.full((4, 2, 8), float(rank))  # [sequence, micro batch, hidden]
            with CommCounter() as counter:
                if parallel.is_first_stage():
                    communicator.send_forward(activation, is_last_stage=False)
                    received = None
                else:
                    received = communicator.recv_forward((4, 2, 8), is_first_stage=False)
            found["batched" if batched else "plain"] = {
                "summary": counter.summary(coordinates),
                "expected_bytes": activation.numel() * FLOAT,
                "received": None if received is None else float(received.mean())}
        return found

    def megatron_tensor_parallel():
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        parallel.initialize(2, 1)
        coordinates = rank_coordinates()
        value = torch.full((3, 4), float(rank + 1))
        with CommCounter() as counter:
            reduced = reduce_from_tensor_model_parallel_region(value)
        return {"summary": counter.summary(coordinates), "expected_bytes": value.numel() * FLOAT,
                "value": float(reduced[0, 0])}

    def kinds():
        coordinates = {0: {"tp": 0, "pp": 0, "dp": 0}, 1: {"tp": 1, "pp": 0, "dp": 0},
                       2: {"tp": 0, "pp": 1, "dp": 0}, 3: {"tp": 1, "pp": 1, "dp": 0}}
        return {"tp": group_kind([0, 1], coordinates), "pp": group_kind([1, 3], coordinates),
                "tp+pp": group_kind([0, 1, 2, 3], coordinates), "self": group_kind([2], coordinates)}

    checks.run("known_all_reduce", known_all_reduce)
    checks.run("gathers_and_scatters", gathers_and_scatters)
    checks.run("batched_p2p", batched_p2p)
    checks.run("coalesced_all_reduce", coalesced_all_reduce)
    checks.run("object_collective_and_restore", object_collective_and_restore)
    checks.run("megatron_pipeline_p2p", megatron_pipeline_p2p)
    checks.run("megatron_tensor_parallel", megatron_tensor_parallel)
    checks.run("kinds", kinds)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
