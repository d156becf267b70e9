"""LoGRA: low-rank gradient sketches written by the backward, Adam in sketch space.

- ``config.py``      LogRAConfig (rank, refresh interval, moment policy, ZeRO-1 mode)
- ``sketch.py``      LinearSketch and the autograd function whose backward writes the sketch
- ``layers.py``      sketching Column/RowParallelLinear and ``logra_layer_spec()``
- ``projection.py``  seeded orthonormal projections and the randomized range finder
- ``optimizer.py``   LogRAOptimizer: sketch-space AdamW + Megatron's optimizer for the rest
- ``accounting.py``  bytes of grads / optimizer state / projections, dense vs LoGRA
"""

from logra_megatron.logra.config import LogRAConfig, parse_rank
from logra_megatron.logra.layers import logra_layer_spec, sketched_modules
from logra_megatron.logra.optimizer import LogRAOptimizer

__all__ = ["LogRAConfig", "LogRAOptimizer", "logra_layer_spec", "parse_rank", "sketched_modules"]
