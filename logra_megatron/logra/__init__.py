"""LoGRA: low-rank gradient sketches written by the backward, an update rule in sketch space.

- ``config.py``         LogRAConfig (rank, refresh interval, moment policy, ZeRO-1 mode)
- ``sketch.py``         LinearSketch and the autograd function whose backward writes the sketch
- ``layers.py``         sketching Column/RowParallelLinear and ``logra_layer_spec()``
- ``projection.py``     seeded orthonormal projections and the randomized range finder
- ``sketch_buffer.py``  the flat sketch buffer: per-weight bookkeeping, DP all-reduce / ZeRO-1
                        reduce-scatter, the sketch part of the gradient norm
- ``update_rules.py``   the update-rule interface and its registry ``UPDATE_RULES``
- ``update_adamw.py``   SketchAdamW: torch's AdamW arithmetic in sketch space (rule "adam")
- ``update_rowadam.py`` RowAdam: the reference implementation's rule (rule "rowadam")
- ``update_memory.py``  what an update rule holds in memory, declared without torch (the planner reads it)
- ``refresh.py``        the refresh policy: test matrices, range-finder bases, state rotation
- ``sketch_optimizer.py`` SketchSpaceOptimizer: the sketched weights' ``MegatronOptimizer``
                        (reduce, norm, clip, the rule's update, masters, refresh, checkpoints)
- ``optimizer.py``      LogRAOptimizer: Megatron's ``ChainedOptimizer`` of Megatron's dense
                        optimizers and the sketch space; ``get_logra_optimizer``, its factory
- ``accounting.py``     planned bytes of grads / optimizer state / projections, dense vs LoGRA
"""

import importlib

# The names below are resolved on first use (PEP 562) rather than imported here: importing
# ``logra_megatron.logra.config`` (which the command line's config schema does) must not load
# megatron-core, so that a bad flag fails in a second or two.
_EXPORTS = {
    "LogRAConfig": "config", "parse_rank": "config",
    "logra_layer_spec": "layers", "sketched_modules": "layers",
    "LogRAOptimizer": "optimizer", "get_logra_optimizer": "optimizer",
    "SketchSpaceOptimizer": "sketch_optimizer",
    "UPDATE_RULES": "update_rules",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
