"""The rollout-engine interface and the registry of engines by their ``--rollout-engine`` name.

An engine samples completions from the current policy (:meth:`RolloutEngine.generate`) and is
told when the trainer's weights changed (:meth:`RolloutEngine.sync_weights`). The trainer uses
nothing else of it, so an engine that runs its own copy of the weights (vLLM) and one that runs
the trainer's own model (the embedded Megatron KV-cache generator) are interchangeable.

Every rank of a model replica calls both methods with the same arguments (collective over the
replica's tensor- and pipeline-parallel groups); data-parallel replicas call them independently.

Torch-free to import (the types of the interface are read for annotations only), so that the
planner's command line takes ``--rollout-engine`` and reads a package engine's memory without
loading torch (tools/plan_memory.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import TYPE_CHECKING, Dict, Optional, Protocol, Sequence, runtime_checkable

from logra_megatron.engine_memory import KEEPS_ITS_OWN_WEIGHTS, EngineMemory
from logra_megatron.errors import UserError
from logra_megatron.registry import Registry

if TYPE_CHECKING:
    from logra_megatron.rollout.types import Rollouts, SamplingConfig


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer asks of a rollout engine."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> Rollouts:
        """``sampling.samples_per_prompt`` completions of every prompt (lists of token ids), as
        one left-padded :class:`Rollouts` batch, identical on every rank of the replica.
        ``Rollouts.logprobs`` holds the engine's own log-probs of the sampled tokens where the
        engine computes them (None otherwise)."""

    def sync_weights(self, model) -> Dict[str, float]:
        """Make the engine sample from ``model``'s current weights (this rank's Megatron stage,
        DDP-wrapped or not). Returns what the sync measured: ``sync_bytes`` (bytes the engine
        was sent) and ``sync_time_s``."""


def _is_engine(obj) -> Optional[str]:
    if not isinstance(obj, type):
        return "an engine is a class, constructed as Engine(model, **options)"
    missing = [name for name in ("generate", "sync_weights") if not hasattr(obj, name)]
    return f"the class lacks {', '.join(missing)} (rollout/engine.py: RolloutEngine)" if missing else None


ROLLOUT_ENGINES = Registry("rollout engine", "--rollout-engine", accepts=_is_engine)
"""``--rollout-engine`` name -> ``"module:Class"``; ``Class(model, **options)`` is an engine that
samples from ``model``. Named by path, not imported here: the config schema reads the names, and
only the chosen engine's module (and its dependencies, vLLM for instance) is ever imported. Outside
code comes by ``package.module:Class``. ``requires``: (the Python package it needs, how to install
it), checked without importing it. ``memory``: the ``"module:attr"`` of the engine's memory
declaration, the object its class's ``memory`` attribute is (engine_memory.py), read without
importing the engine's module (:func:`engine_memory`)."""
ROLLOUT_ENGINES.register("megatron", "logra_megatron.rollout.megatron_engine:MegatronEngine",
                         memory="logra_megatron.engine_memory:SAMPLES_WITH_TRAINER_WEIGHTS",
                         help="KV-cache generation on the trainer's own model")
ROLLOUT_ENGINES.register("vllm", "logra_megatron.rollout.vllm_engine:VLLMEngine",
                         memory="logra_megatron.engine_memory:RESERVES_ONE_KV_CACHE",
                         help="a vLLM engine on each replica's first rank, in-process in a one-process job, sent the "
                              "weights after every step; pip install -e .[rollout]; on CPU a preset's heads narrower "
                              "than 32 are widened to 32",
                         requires=("vllm", "pip install -e .[rollout]"))

def check_engine_available(name: str) -> None:
    """A one-line :class:`UserError` saying how to install what engine ``name`` needs when that
    package is missing. Looks the package up without importing it (importing vLLM takes seconds)."""
    entry = ROLLOUT_ENGINES.declared(name)
    if entry is None or "requires" not in entry.info:
        return
    package, install = entry.info["requires"]
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"--rollout-engine {name} needs the {package!r} package, which is not installed; "
                        f"install it with: {install}")


def engine_memory(name: str) -> EngineMemory:
    """What engine ``name`` declares it holds beside the trainer (its class's ``memory``,
    engine_memory.py); an engine that declares nothing is planned with its own copy of the weights.
    A package engine's declaration is read through its registry line (``memory=``), without
    importing the engine; outside code's by importing its module, not what it runs on."""
    entry = ROLLOUT_ENGINES.declared(name)
    path = entry.info.get("memory") if entry is not None else None
    if path is None:
        return getattr(ROLLOUT_ENGINES.get(name), "memory", KEEPS_ITS_OWN_WEIGHTS)
    module, attr = path.split(":", 1)
    return getattr(importlib.import_module(module), attr)


def engine_syncs_low_rank(name: str) -> bool:
    """Whether engine ``name`` takes ``--policy-sync lowrank``: its class lists it in
    ``policy_syncs`` (rollout/remote_engine.py: ``RemoteEngine`` does; an engine that samples from
    the trainer's own weights has no copy to update). Imports the engine's module, not what it
    runs on (vLLM is imported when the engine first runs)."""
    return "lowrank" in getattr(ROLLOUT_ENGINES.get(name), "policy_syncs", ("full",))


def build_rollout_engine(name: str, model, **options) -> RolloutEngine:
    """The engine ``name`` names, sampling from ``model`` (this rank's stage of the policy).

    ``options`` are engine settings (``model_config``, ``vocab_size``, ``sync_bucket_mb``, ...);
    each engine receives the ones its constructor names and ignores the rest, so the caller
    passes the same options whichever engine is chosen. Building imports nothing the engine
    needs beyond this package (vLLM is imported when the engine first runs);
    :func:`check_engine_available` is the early check."""
    engine_class = ROLLOUT_ENGINES.get(name)
    accepted = inspect.signature(engine_class).parameters
    return engine_class(model, **{key: value for key, value in options.items() if key in accepted})
