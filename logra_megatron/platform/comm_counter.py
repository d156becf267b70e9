"""Measured communication: the bytes each torch.distributed call was actually given, by
operation and by process group.

``with CommCounter() as comm: ...`` replaces the collective and point-to-point functions of
``torch.distributed`` for the block and records, for every call, the operation's name, the
ranks of its group and the bytes of the tensors it was passed. Megatron (0.16) and this project
call them through the module at call time (``torch.distributed.all_reduce(...)``,
``dist.isend`` in a ``P2POp``), never through a name bound at import, so replacing the
module's attributes sees every call. The functions are replaced in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` alike: torch's own wrappers (``all_gather_object``,
``broadcast_object_list``, ``_all_gather_base`` -> ``all_gather_single``, ``batch_isend_irecv``
-> ``isend``/``irecv``) then pass through the counter too, and only the outermost call is
counted, so a payload is never counted twice. Collectives queued inside Megatron's
``_coalescing_manager`` are counted when queued (torch sends them in one batch at its exit).

The bytes of a call are the size of the whole buffer the operation works on: the tensor of an
all-reduce, broadcast, reduce, send or receive; the (unsharded) input of a reduce-scatter; the
(gathered) output of an all-gather; the input of an all-to-all. How many bytes cross a link for
it depends on the algorithm (a ring all-reduce sends ``2 (n - 1) / n`` of it from each rank).

:func:`group_kind` names a group by the parallel dimensions its members differ in, given every
rank's coordinates (``{"tp": .., "pp": .., "dp": ..}``): ``"tp"``, ``"pp"``, ``"dp"``, a
combination such as ``"tp+pp"`` (Megatron's model-parallel group), or ``"self"`` for a group of
one rank (which moves nothing).

A ``P2POp`` must be built and run inside the same block (torch tells sends from receives by
comparing its function with ``torch.distributed.isend``); Megatron builds them right before it
runs them.
"""

import inspect
import threading
from collections import defaultdict
from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _size(tensor) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _total(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return _size(tensors)
    return sum(_total(item) for item in tensors or ())


# operation -> (the argument holding its whole buffer, how to size it)
_PAYLOAD = {
    "all_reduce": ("tensor", _size),
    "all_reduce_coalesced": ("tensors", _total),
    "broadcast": ("tensor", _size),
    "reduce": ("tensor", _size),
    "send": ("tensor", _size),
    "recv": ("tensor", _size),
    "isend": ("tensor", _size),
    "irecv": ("tensor", _size),
    "gather": ("tensor", _size),
    "scatter": ("tensor", _size),
    "all_gather": ("tensor_list", _total),
    "all_gather_into_tensor": ("output_tensor", _size),
    "_all_gather_base": ("output_tensor", _size),
    "all_gather_single": ("output_tensor", _size),
    "all_gather_coalesced": ("output_tensor_lists", _total),
    "reduce_scatter": ("input_list", _total),
    "reduce_scatter_tensor": ("input", _size),
    "_reduce_scatter_base": ("input", _size),
    "reduce_scatter_single": ("input", _size),
    "all_to_all_single": ("input", _size),
    "all_to_all": ("input_tensor_list", _total),
}
COUNTED_OPS = tuple(name for name in _PAYLOAD if hasattr(c10d, name))
"""The operations this torch build has (older builds lack the ``*_single`` names)."""


def group_kind(ranks: Iterable[int], coordinates: Dict[int, Dict[str, int]]) -> str:
    """The parallel dimensions a group spans: the coordinates (``tp``, ``pp``, ``dp``) in which
    its ranks differ, joined by ``+``; ``"self"`` for a single rank."""
    ranks = list(ranks)
    if len(ranks) < 2:
        return "self"
    dims = [dim for dim in ("tp", "pp", "dp")
            if len({coordinates[rank][dim] for rank in ranks}) > 1]
    return "+".join(dims) if dims else "self"


class CommCounter:
    """Counts the calls and bytes of torch.distributed operations made inside a ``with`` block.

    ``records`` maps ``(operation, group ranks)`` to ``{"calls": n, "bytes": b}``;
    :meth:`summary` groups them by :func:`group_kind`. Counters may nest (each counts the calls
    made while it is open)."""

    def __init__(self):
        self.records = defaultdict(lambda: {"calls": 0, "bytes": 0})
        self._local = threading.local()
        self._saved = []

    def __enter__(self):
        if self._saved:
            raise RuntimeError("a CommCounter is not reentrant; open a new one")
        for name in COUNTED_OPS:
            wrapper = self._wrap(name, getattr(c10d, name))
            for module in (dist, c10d):
                if hasattr(module, name):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []
        return False

    def _wrap(self, name, original):
        signature = inspect.signature(original)
        argument, size = _PAYLOAD[name]
        local = self._local

        def counted(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                bound = signature.bind_partial(*args, **kwargs).arguments
                group = bound.get("group")
                if group is None:
                    group = c10d._get_default_group()
                record = self.records[(name, tuple(dist.get_process_group_ranks(group)))]
                record["calls"] += 1
                record["bytes"] += size(bound.get(argument))
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth

        counted.__name__ = getattr(original, "__name__", name)
        counted.__wrapped__ = original
        return counted

    def total_bytes(self) -> int:
        return sum(record["bytes"] for record in self.records.values())

    def summary(self, coordinates: Optional[Dict[int, Dict[str, int]]] = None) -> dict:
        """``{"by_kind": {kind: bytes}, "by_op": {operation: {kind: {"calls", "bytes"}}}}``.
        Without ``coordinates`` a group is named by its ranks (``"ranks 0,1"``)."""
        by_kind = defaultdict(int)
        by_op = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0}))
        for (name, ranks), record in sorted(self.records.items()):
            kind = group_kind(ranks, coordinates) if coordinates is not None \
                else "ranks " + ",".join(map(str, ranks))
            by_kind[kind] += record["bytes"]
            entry = by_op[name][kind]
            entry["calls"] += record["calls"]
            entry["bytes"] += record["bytes"]
        return {"by_kind": dict(by_kind), "by_op": {name: dict(kinds) for name, kinds in by_op.items()}}
