"""The worker's side of a :class:`~logra_megatron.rollout.remote_engine.RemoteEngine`: the calls
the engine's rank makes into the process that holds the engine's weights. A concrete worker
mixes it into its runtime's worker and supplies ``reload_weights(weights_iterator=...)``, which
replaces the engine's weights by the (Hugging Face name, tensor) pairs it is given
(logra_megatron/rollout/vllm_worker.py: vLLM's own method of that name).

``logra_load`` is a full sync; with routes (a low-rank sync will follow) the worker also keeps an
fp32 copy of the weights under the names they were sent with, and the projections. A low-rank
sync (``logra_apply``) replays the steps onto that copy
(:func:`~logra_megatron.rollout.policy_update.replay`: ``W <- (1 - step wd) W - step (U Q^T)``
or ``- step (P U)``, the trainer's own operations), copies the dense remainder in, and reloads
the engine's weights from the copy.

Why a copy: an engine may hold its weights in a form that cannot be updated in place (vLLM's CPU
backend packs each linear weight for its GEMM kernel and frees the unpacked one); the fp32 copy
also accumulates the steps of a bf16 engine without rounding each one away (the trainer's fp32
masters do the same), so a bf16 engine's weights are the rounded copy, as the trainer's are its
rounded masters. It costs the engine 4 bytes per parameter beside its own weights.
"""

from typing import Dict, Iterable, Optional, Tuple

import torch

from logra_megatron.rollout.policy_update import replay


class RemoteWorker:
    """``logra_load`` (a full sync that keeps the copy) and ``logra_apply`` (a low-rank sync).
    The class it is mixed into supplies ``reload_weights(weights_iterator=...)``. Nothing here
    may share a name with that class (vLLM refuses an extension whose names clash with its
    worker's, which is also why the base declares no ``reload_weights`` of its own, and why the
    methods carry a prefix)."""

    def logra_call_from_file(self, method: str, path: str):
        """``method(**arguments)`` with the arguments a separate engine process cannot receive
        through an RPC that does not carry tensors: read from ``path``, a file the trainer wrote
        with ``torch.save`` (memory-mapped: the tensors are read as they are loaded)."""
        arguments = torch.load(path, mmap=True, weights_only=False)
        if "weights" in arguments:
            arguments["weights_iterator"] = iter(arguments.pop("weights").items())
        return getattr(self, method)(**arguments)

    @torch.no_grad()
    def logra_load(self, weights_iterator: Iterable[Tuple[str, torch.Tensor]],
                   projections: Optional[Dict[str, tuple]] = None, routes=None) -> None:
        """Load every tensor into the engine; with ``routes`` (a low-rank sync will follow) keep
        an fp32 copy of each and remember the projections (Megatron name -> (side, tensor))."""
        shadow: Optional[Dict[str, torch.Tensor]] = {} if routes is not None else None

        def keep():
            for name, tensor in weights_iterator:
                if shadow is not None:
                    shadow[name] = tensor.detach().to(torch.float32, copy=True)
                yield name, tensor

        self.logra_shadow = None  # a failed load leaves no copy that claims to be current
        self.reload_weights(weights_iterator=keep())
        self.logra_shadow = shadow
        self.logra_projections = {key: (side, tensor.float()) for key, (side, tensor) in (projections or {}).items()}
        self.logra_routes = routes

    @torch.no_grad()
    def logra_apply(self, message, dtype: torch.dtype) -> None:
        """Replay ``message`` (a :class:`~logra_megatron.rollout.policy_update.LowRankMessage`)
        onto the copy and reload the engine's weights from it, cast to ``dtype``."""
        shadow, routes = getattr(self, "logra_shadow", None), getattr(self, "logra_routes", None)
        if shadow is None or routes is None:
            raise RuntimeError("a low-rank sync needs a full sync first (the worker holds no weights to update)")
        self.logra_shadow = None  # until the replay is complete
        replay(shadow, self.logra_projections, routes, message)
        self.reload_weights(weights_iterator=((name, tensor.to(dtype)) for name, tensor in shadow.items()))
        self.logra_shadow = shadow
