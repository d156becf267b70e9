"""The vLLM worker's side of a low-rank policy sync (``--policy-sync lowrank``): mixed into
vLLM's worker class (``LLM(worker_extension_cls=...)``) and called through
``collective_rpc`` by logra_megatron/rollout/vllm_engine.py.

The worker keeps an fp32 copy of the weights of the last full sync, under the Hugging Face
names they were sent with, and the projections. A low-rank sync replays the steps onto that copy
(:func:`~logra_megatron.rollout.policy_update.replay`: ``W <- (1 - step wd) W - step (U Q^T)``
or ``- step (P U)``, the trainer's own operations), copies the dense remainder in, and reloads the engine's weights from the copy through vLLM's own
``reload_weights`` (which fuses q/k/v and gate/up and re-runs the CPU backend's repacking).

Why a copy: vLLM's CPU backend packs each linear weight for its GEMM kernel and frees the
unpacked one, so there is no weight to update in place; the fp32 copy also accumulates the
steps of a bf16 engine without rounding each one away (the trainer's fp32 masters do the same),
so a bf16 engine's weights are the rounded copy, as the trainer's are its rounded masters. It
costs the engine 4 bytes per parameter beside its own weights.
"""

from typing import Dict, Iterable, Optional, Tuple

import torch

from logra_megatron.rollout.policy_update import replay


class LowRankWeights:
    """vLLM worker extension: ``logra_load`` (a full sync that keeps the copy) and
    ``logra_apply`` (a low-rank sync). Method names carry a prefix: vLLM refuses an extension
    whose names clash with the worker's."""

    def logra_call_from_file(self, method: str, path: str):
        """``method(**arguments)`` with the arguments a separate engine process cannot receive
        through vLLM's RPC (tensors do not cross it): read from ``path``, a file the trainer
        wrote with ``torch.save`` (memory-mapped: the tensors are read as they are loaded)."""
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
        shadow, routes = self.logra_shadow, self.logra_routes
        if shadow is None or routes is None:
            raise RuntimeError("a low-rank sync needs a full sync first (the worker holds no weights to update)")
        self.logra_shadow = None  # until the replay is complete
        replay(shadow, self.logra_projections, routes, message)
        self.reload_weights(weights_iterator=((name, tensor.to(dtype)) for name, tensor in shadow.items()))
        self.logra_shadow = shadow
