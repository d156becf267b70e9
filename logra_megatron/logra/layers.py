"""Sketching tensor-parallel linears and the GPT layer spec that swaps them in.

Subclasses of Megatron's ColumnParallelLinear and RowParallelLinear that override only
``_forward_impl`` (the narrow seam every forward goes through). Their weights are marked
``requires_grad = False`` at construction, so Megatron's DDP allocates no dense grad buffer for
them and Megatron's optimizer skips them; the weight gradient exists only as the sketch that
:class:`~logra_megatron.logra.sketch.LinearSketch` accumulates in the backward. Column-parallel
weights get a right sketch, row-parallel weights a left sketch (docs/ALGORITHM.md, "Exactness
across TP").
"""

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from logra_megatron.logra.sketch import LEFT, RIGHT, gather_sequence, sketched_linear
from logra_megatron.models.build import with_attention_backend


class _SketchingMixin:
    sketch_side: str = ""

    def _init_sketching(self):
        self.weight.requires_grad_(False)
        self.weight.logra_sketched = True
        self.weight.logra_side = self.sketch_side
        # Read by the backward; attached by the SketchBuffer (None: no weight gradient at all).
        self.logra_sketch = None
        self.logra_anchor = torch.empty(0, device=self.weight.device, requires_grad=True)

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, tp_group=None, sequence_parallel=False,
                      **_):
        # Megatron passes sequence_parallel=True to column-parallel layers only (a row-parallel
        # layer's reduce-scatter happens outside this seam); its TP group is then ``tp_group`` or
        # the layer's own.
        tp_group = tp_group if tp_group is not None else getattr(self, "tp_group", None)
        if not torch.is_grad_enabled():
            if sequence_parallel:
                input = gather_sequence(input, tp_group)
            output = torch.matmul(input, weight.t())
            sketch = self.logra_sketch
            if sketch is not None and sketch.preview is not None:
                # Inside the row-parallel layer this is this rank's partial sum: the side path
                # is reduced over TP with it (docs/ALGORITHM.md, "KL control").
                output = sketch.preview_output(input, output)
            return output + bias if bias is not None else output
        return sketched_linear(input, weight, bias, self, allreduce_dgrad, tp_group, sequence_parallel)


class SketchingColumnParallelLinear(_SketchingMixin, ColumnParallelLinear):
    """ColumnParallelLinear (weight rows split over TP) with a right gradient sketch."""

    sketch_side = RIGHT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_sketching()


class SketchingRowParallelLinear(_SketchingMixin, RowParallelLinear):
    """RowParallelLinear (weight columns split over TP) with a left gradient sketch."""

    sketch_side = LEFT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_sketching()


def logra_layer_spec(base_spec=None, attention_backend: str = "auto"):
    """The GPT layer spec with linear_qkv, linear_proj, linear_fc1 and linear_fc2 replaced by
    sketching linears and the core attention of ``attention_backend`` (``--attention-backend``).
    ``base_spec`` defaults to the local megatron-core spec with RMSNorm."""
    spec = copy.deepcopy(base_spec if base_spec is not None else get_gpt_layer_local_spec(normalization="RMSNorm"))
    with_attention_backend(spec, attention_backend)
    attention = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    for holder, slot, cls in ((attention, "linear_qkv", SketchingColumnParallelLinear),
                              (attention, "linear_proj", SketchingRowParallelLinear),
                              (mlp, "linear_fc1", SketchingColumnParallelLinear),
                              (mlp, "linear_fc2", SketchingRowParallelLinear)):
        current = getattr(holder, slot)
        expected = ColumnParallelLinear if cls is SketchingColumnParallelLinear else RowParallelLinear
        if not (isinstance(current, type) and issubclass(current, expected)):
            raise ValueError(f"layer spec slot {slot} holds {current}, not a {expected.__name__}; "
                             "LoGRA needs the local (non-Transformer-Engine) layer spec")
        setattr(holder, slot, cls)
    return spec


def sketched_modules(model):
    """``(local_name, module)`` of every sketching module in ``model`` that owns a weight (a
    tied output layer shares the embedding's; logra_megatron/logra/embeddings.py)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, _SketchingMixin) and module.weight is not None]
