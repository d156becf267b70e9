"""Sketched word embeddings and output layer (``--logra-embeddings``; docs/ALGORITHM.md,
"Embeddings").

The embedding ``E`` (``V x h``, vocabulary-parallel: each TP rank holds a block of rows) and the
output layer (``V x h``, a column-parallel linear whose output is the logits) get **right**
sketches with a projection ``Q`` (``h x r``) shared by every TP rank, so a rank's sketch is its
vocabulary block of the TP=1 sketch:

- output layer: ``G = dZ^T H`` and ``G Q = dZ^T (H Q)``, as for any column-parallel linear;
- lookup: ``G = onehot(ids)^T dY``, so ``G Q = onehot^T (dY Q)``: the rows ``dY Q`` (``T x r``)
  are index-added into the ``V x r`` sketch at the looked-up ids (ids of another rank's block
  are skipped). The range finder's sample ``G^T Omega = dY^T Omega[ids]`` and the norm probes'
  ``G Omega' = onehot^T (dY Omega')`` follow the same way.

With tied embeddings both uses feed one sketch (the lookup's and the logits' gradients add,
as Megatron adds them into one ``main_grad``); under pipeline parallelism the last stage's copy
of the tied weight gets the same projection (seeded by the embedding's name), and its sketch is
summed with the first stage's over Megatron's embedding group, as Megatron all-reduces the
dense gradient there.

GPTModel builds these two layers itself, not through the layer spec, so :func:`sketch_embeddings`
swaps the class of the built modules (each subclass overrides only the forward seam).
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from logra_megatron.logra.layers import _SketchingMixin
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.models.build import model_device


class _SketchedLookupFunction(torch.autograd.Function):
    """``E[ids]``; the backward only feeds the owner's sketch (no dense gradient of ``E``)."""

    @staticmethod
    def forward(ctx, ids, weight, anchor, owner, valid):
        ctx.save_for_backward(ids, valid)
        ctx.owner = owner
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, valid = ctx.saved_tensors
        sketch = ctx.owner.logra_sketch
        if sketch is not None:
            flat = grad_output.reshape(-1, grad_output.shape[-1])
            sketch.accumulate_lookup(ids.reshape(-1), flat, valid.reshape(-1))
        return None, None, None, None, None


class SketchingVocabParallelEmbedding(_SketchingMixin, VocabParallelEmbedding):
    """VocabParallelEmbedding whose weight gradient exists only as a right sketch."""

    sketch_side = RIGHT

    def forward(self, input_):
        if self.tp_group.size() > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = input_.clone() - self.vocab_start_index
            ids[outside] = 0
        else:
            outside = torch.zeros_like(input_, dtype=torch.bool)
            ids = input_
        sketch = self.logra_sketch
        if torch.is_grad_enabled():
            output = _SketchedLookupFunction.apply(ids, self.weight, self.logra_anchor, self, ~outside)
        else:
            output = F.embedding(ids, self.weight)
            if sketch is not None and sketch.preview is not None:
                output = sketch.preview_lookup(ids, output)
        if self.tp_group.size() > 1:
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            raise ValueError("LoGRA's sketched embeddings do not support sequence parallelism")
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


class SketchingOutputLayer(_SketchingMixin, ColumnParallelLinear):
    """The output layer with a right sketch; with tied embeddings it owns no weight and feeds
    the embedding's sketch (the tied weight arrives as the forward's ``weight``)."""

    sketch_side = RIGHT


def sketch_embeddings(model, vocab_size: int) -> None:
    """Make ``model``'s (a GPTModel stage) word embedding and output layer sketching, in place,
    before Megatron's DDP wraps it (their weights leave the dense optimizer). ``vocab_size`` is
    the real vocabulary (checkpoints keep only its rows)."""
    if model.pre_process:
        embedding = model.embedding.word_embeddings
        embedding.__class__ = SketchingVocabParallelEmbedding
        embedding._init_sketching()
        embedding.logra_vocab_size = vocab_size
    if model.post_process:
        output = model.output_layer
        output.__class__ = SketchingOutputLayer
        output.logra_vocab_size = vocab_size
        if output.weight is not None:  # untied, or the last stage's copy of a tied weight
            output._init_sketching()
        else:
            output.logra_sketch = None
            output.logra_anchor = torch.empty(0, device=model_device(model), requires_grad=True)


def shares_the_embedding(model) -> bool:
    """True on a last stage holding the pipeline copy of a tied embedding."""
    return bool(model.share_embeddings_and_output_weights and model.post_process and not model.pre_process)
