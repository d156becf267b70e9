"""What a rollout engine colocated with the trainer holds on one GPU, declared by the engine.

An engine class names its declaration in its ``memory`` attribute (``MegatronEngine``: it samples
with the trainer's own weights; ``RemoteEngine``: it keeps a copy of them; ``VLLMEngine``: a copy
and the one KV cache it reserves, :class:`ReservedKVCache`, which it sizes itself with); the
trainer's start-up plan and the planner's ``--rollout-engine`` read it through
``rollout/engine.py: engine_memory`` and the planner adds up what it says (``planning/state.py``). An engine with another cache layout declares its own ``EngineMemory``
subclass, and no file of the planner changes.

Torch-free and importing nothing of the package, so that the planner (a lower layer than the
engines, docs/ARCHITECTURE.md) can read it without loading torch.
"""

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class EngineMemory:
    """A KV cache of K and V per layer for every sequence in flight at its full length (static
    batching: ``rollout/megatron_engine.py`` allocates Megatron's ``StaticInferenceContext`` for
    the whole batch at once), and, when ``own_weights``, a copy of the rank's weights in the
    engine's precision (sharded like the trainer's)."""

    own_weights: bool = True

    def kv_cache_bytes(self, layers: int, kv_heads: int, kv_channels: int, tokens: int, dtype_bytes: int) -> int:
        """``2 (K and V) x layers x kv heads (this rank's) x head dim x tokens x bytes``."""
        return 2 * layers * kv_heads * kv_channels * tokens * dtype_bytes

    def cache_bytes(self, *, layers: int, kv_heads: int, kv_channels: int, sequences: int, max_tokens: int,
                    model_max_tokens: int, dtype_bytes: int) -> int:
        """The KV cache with ``sequences`` in flight of ``max_tokens`` each: all of them at full
        length (``model_max_tokens``, the model's longest sequence, is for an engine that sizes
        its cache by it)."""
        return self.kv_cache_bytes(layers, kv_heads, kv_channels, sequences * max_tokens, dtype_bytes)

    def bytes(self, *, layers: int, kv_heads: int, kv_channels: int, sequences: int, max_tokens: int,
              model_max_tokens: int, dtype_bytes: int, weight_numel: int) -> int:
        """All the engine holds on one rank: ``layers`` and ``kv_heads`` are this rank's (its
        pipeline stage's, its TP share), ``weight_numel`` the elements of this rank's weights;
        nothing when no sequence is in flight (no engine)."""
        weights = weight_numel * dtype_bytes if self.own_weights and sequences > 0 else 0
        return weights + self.cache_bytes(layers=layers, kv_heads=kv_heads, kv_channels=kv_channels,
                                          sequences=sequences, max_tokens=max_tokens,
                                          model_max_tokens=model_max_tokens, dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class ReservedKVCache(EngineMemory):
    """A paged KV cache of one size, reserved when the engine starts (vLLM's
    ``kv_cache_memory_bytes``): ``kv_cache_mb`` MiB, raised to what ``longest_sequences``
    sequences of the model's longest length need (vLLM refuses a cache that cannot hold one
    sequence of its ``max_model_len``). The sequences in flight share it (the engine queues or
    preempts what does not fit), so it does not grow with them. The engine sizes its cache with
    :meth:`reserved_bytes` (rollout/vllm_engine.py), so the plan and the engine agree."""

    kv_cache_mb: int = 256
    longest_sequences: int = 2

    def reserved_bytes(self, *, layers: int, kv_heads: int, kv_channels: int, model_max_tokens: int,
                       dtype_bytes: int) -> int:
        """What the engine reserves for a model of ``layers`` x ``kv_heads`` x ``kv_channels``
        whose longest sequence is ``model_max_tokens``."""
        longest = self.kv_cache_bytes(layers, kv_heads, kv_channels, self.longest_sequences * model_max_tokens,
                                      dtype_bytes)
        return max(self.kv_cache_mb * MIB, longest)

    def cache_bytes(self, *, layers: int, kv_heads: int, kv_channels: int, sequences: int, max_tokens: int,
                    model_max_tokens: int, dtype_bytes: int) -> int:
        if sequences == 0:
            return 0
        return self.reserved_bytes(layers=layers, kv_heads=kv_heads, kv_channels=kv_channels,
                                   model_max_tokens=model_max_tokens, dtype_bytes=dtype_bytes)


SAMPLES_WITH_TRAINER_WEIGHTS = EngineMemory(own_weights=False)
"""The embedded Megatron engine: its sampling reads the trainer's live weights."""
KEEPS_ITS_OWN_WEIGHTS = EngineMemory(own_weights=True)
"""An engine on another runtime (any ``RemoteEngine``): the weights are sent to its copy."""
RESERVES_ONE_KV_CACHE = ReservedKVCache()
"""vLLM's (``VLLMEngine.memory``): its weights' copy and one KV cache of ``kv_cache_mb`` MiB or
two of the model's longest sequences."""
