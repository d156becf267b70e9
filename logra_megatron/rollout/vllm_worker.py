"""The vLLM engine's worker extension (``LLM(worker_extension_cls=WORKER_EXTENSION)``, called
through ``collective_rpc`` by logra_megatron/rollout/vllm_engine.py): the remote engine's worker
calls (logra_megatron/rollout/remote_worker.py: full sync, low-rank replay on an fp32 copy)
mixed into vLLM's worker class.

vLLM's worker supplies ``reload_weights``: it loads (HF name, tensor) pairs through the model's
own loader (which fuses q/k/v and gate/up) and re-runs the CPU backend's weight repacking for
each layer once all of its tensors arrived.
"""

from logra_megatron.rollout.remote_worker import RemoteWorker


class LowRankWeights(RemoteWorker):
    """vLLM worker extension: adds nothing to :class:`RemoteWorker`; vLLM appends it to its
    worker class's bases, whose own ``reload_weights`` it calls."""
