"""Gradient sketches written directly by a linear layer's backward.

For ``Y = X W^T`` (``W`` is ``m x n``, ``X`` is ``T x n``) the dense weight gradient is
``G = dY^T X``. It is never formed; instead the backward accumulates

- a **right** sketch ``S = G Q = dY^T (X Q)`` (``m x r``, projection ``Q`` is ``n x r``), used for
  column-parallel weights (each TP rank holds rows of ``W``; ``Q`` is shared, so the ranks'
  sketches are exactly the row blocks of the TP=1 sketch), or
- a **left** sketch ``S = P^T G = (dY P)^T X`` (``r x n``, ``P`` is ``m x r``), used for
  row-parallel weights (each rank holds columns of ``W``; ``P`` is shared).

Both cost two thin matmuls, ``2 T r (m + n)`` FLOPs instead of ``2 T m n``. Microbatches add
into the same sketch (it is linear in ``G``). On a refresh step the same backward also
accumulates the range-finder sample ``G Omega`` (left) or ``G^T Omega`` (right) for the next
projection (see :mod:`logra_megatron.logra.projection`).
"""

from typing import Optional

import torch
import torch.distributed as dist

from logra_megatron.logra.sketch_memory import LEFT, RIGHT, SketchedWeight  # noqa: F401 (the sides, named here too)

PREVIEW_CPU_CHUNK_ELEMENTS = 1 << 15
"""Elements per chunk of a previewed output's fp32 round trip on the CPU (128 KiB in fp32: it
stays in cache). In one piece the round trip of a ``[1024, 3072]`` bf16 output (``smollm2-135m``'s
``linear_fc1``, 8 x 128 tokens) cost 13.3 ms, in chunks 2.9 ms (one thread, this project's CPU;
docs/KL_CONTROL.md). On an accelerator it stays one piece: a kernel launch per chunk would cost
more than the cache saves."""


class LinearSketch:
    """The sketch state of one weight shard: projection, sketch accumulator, range finder.

    ``out_features`` x ``in_features`` is this rank's shard of the weight. ``projection`` is
    ``in_features x r`` (right) or ``out_features x r`` (left); the full, unsharded projected
    dimension is never split (that is why each side is chosen for its parallel type).
    """

    def __init__(self, name: str, side: str, out_features: int, in_features: int,
                 projection: torch.Tensor, sketch: torch.Tensor):
        assert side in (LEFT, RIGHT)
        self.name = name
        self.side = side
        self.out_features = out_features
        self.in_features = in_features
        self.projection = projection
        self.sketch = sketch
        # Range finder (only during a refresh step): this rank's rows of the Gaussian test
        # matrix and the accumulated sample.
        self.test_matrix: Optional[torch.Tensor] = None
        self.range_sample: Optional[torch.Tensor] = None
        # Gradient-norm probes (docs/ALGORITHM.md, "Gradient norm"): Omega' = (I - Q Q^T) Omega
        # (projected dim x k) and the accumulated residual sample G Omega' (right) or
        # Omega'^T G (left); None when the norm is not estimated.
        self.norm_probe: Optional[torch.Tensor] = None
        self.norm_sample: Optional[torch.Tensor] = None
        # A proposed update shown to forward passes without touching the weight (the KL
        # controller's forecast, docs/ALGORITHM.md "KL control"): (step, weight_decay, U) means
        # W + step * (-weight_decay * W - dW(U)); None: the weight as it is.
        self._preview: Optional[tuple] = None
        # The preview's factors in a 16-bit model's dtype, cast once per preview rather than at
        # every microbatch's forward: (dtype, projection, U); dropped with the preview.
        self._preview_factors: Optional[tuple] = None
        # Called with this sketch after each backward adds to it (the overlapped reduction's
        # report, logra/sketch_overlap.py); None: nobody listens.
        self.on_accumulated = None

    @property
    def rank(self) -> int:
        return self.projection.shape[1]

    @staticmethod
    def sketch_shape(side: str, out_features: int, in_features: int, rank: int):
        return SketchedWeight(side, out_features, in_features, rank).sketch_shape

    @torch.no_grad()
    def accumulate(self, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        """Add this microbatch's sketch: ``grad_output`` is ``T x out``, ``inputs`` ``T x in``."""
        grad_output = grad_output.float()
        inputs = inputs.float()
        if self.side == RIGHT:
            self.sketch.addmm_(grad_output.t(), inputs @ self.projection)
        else:
            self.sketch.addmm_((grad_output @ self.projection).t(), inputs)
        if self.test_matrix is not None:
            if self.side == RIGHT:
                # G^T Omega = X^T (dY Omega), Omega has this rank's out rows.
                self.range_sample.addmm_(inputs.t(), grad_output @ self.test_matrix)
            else:
                # G Omega = dY^T (X Omega), Omega has this rank's in rows.
                self.range_sample.addmm_(grad_output.t(), inputs @ self.test_matrix)
        if self.norm_probe is not None:
            if self.side == RIGHT:  # G Omega' = dY^T (X Omega'), m x k
                self.norm_sample.addmm_(grad_output.t(), inputs @ self.norm_probe)
            else:  # Omega'^T G = (dY Omega')^T X, k x n
                self.norm_sample.addmm_((grad_output @ self.norm_probe).t(), inputs)
        if self.on_accumulated is not None:
            self.on_accumulated(self)

    @torch.no_grad()
    def accumulate_lookup(self, ids: torch.Tensor, grad_output: torch.Tensor, valid: torch.Tensor) -> None:
        """Add an embedding lookup's sketch (right side only): ``G = onehot(ids)^T dY``, so
        ``G Q = onehot^T (dY Q)`` is an index-add of ``dY Q`` rows; ``valid`` marks the ids in
        this rank's vocabulary block (logra_megatron/logra/embeddings.py)."""
        ids, grad_output = ids[valid], grad_output[valid].float()
        self.sketch.index_add_(0, ids, grad_output @ self.projection)
        if self.test_matrix is not None:  # G^T Omega = dY^T Omega[ids]
            self.range_sample.addmm_(grad_output.t(), self.test_matrix[ids])
        if self.norm_probe is not None:  # G Omega' = onehot^T (dY Omega')
            self.norm_sample.index_add_(0, ids, grad_output @ self.norm_probe)
        if self.on_accumulated is not None:
            self.on_accumulated(self)

    def update_from(self, low_rank_update: torch.Tensor) -> torch.Tensor:
        """Map a sketch-space update back to this weight shard's full size (a dense m x n
        tensor: for tests and small weights; the optimizer applies updates by row blocks with
        :meth:`update_factors`)."""
        if self.side == RIGHT:
            return low_rank_update @ self.projection.t()
        return self.projection @ low_rank_update

    def update_factors(self, low_rank_update: torch.Tensor, rows: slice):
        """``(A, B)`` with ``A @ B`` = rows ``rows`` of the full-size update, so a row block of
        ``W`` is updated in place by ``addmm_`` without the dense m x n product existing."""
        if self.side == RIGHT:
            return low_rank_update[rows], self.projection.t()
        return self.projection[rows], low_rank_update

    @property
    def preview(self) -> Optional[tuple]:
        return self._preview

    @preview.setter
    def preview(self, value: Optional[tuple]) -> None:
        self._preview, self._preview_factors = value, None

    def _factors_in(self, dtype: torch.dtype):
        """The projection and the proposed ``U`` in ``dtype`` (cast once per preview)."""
        if self._preview_factors is None or self._preview_factors[0] != dtype:
            self._preview_factors = (dtype, self.projection.to(dtype), self._preview[2].to(dtype))
        return self._preview_factors[1:]

    def preview_output(self, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``X (W + s D)^T`` from ``output = X W^T`` and the factors of ``D`` (:attr:`preview`),
        with two thin matmuls: ``(1 - s wd) X W^T - s (X Q) U^T`` (right) or
        ``- s (X U^T) P^T`` (left). The side path runs in the input's dtype (a 16-bit model's
        side term carries 2^-8 relative rounding, far below that of the output it corrects;
        in fp32 it was 40% of a previewed forward's time on CPU, measured on smollm2-135m), and
        is added to the output in fp32."""
        flat = inputs.reshape(-1, inputs.shape[-1])
        projection, update = self._factors_in(flat.dtype)
        if self.side == RIGHT:
            side = (flat @ projection) @ update.t()
        else:
            side = (flat @ update.t()) @ projection.t()
        return self._previewed(output, side.reshape(output.shape))

    def preview_lookup(self, ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``(E + s D)[ids]`` from ``output = E[ids]`` (a right sketch: ``D = -wd E - U Q^T``)."""
        update = self.preview[2]
        return self._previewed(output, update[ids] @ self.projection.t())

    def _previewed(self, output: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """``(1 - s wd) output - s side`` in fp32, returned in ``output``'s dtype (a new tensor,
        never the output itself, even in fp32). On the CPU the fp32 round trip runs over row
        chunks of :data:`PREVIEW_CPU_CHUNK_ELEMENTS` (elementwise: the same bits as one piece)."""
        step, weight_decay, _ = self.preview
        width = output.shape[-1]
        flat, flat_side = output.reshape(-1, width), side.reshape(-1, width)
        result = torch.empty(flat.shape, dtype=output.dtype, device=output.device)
        rows = flat.shape[0] if output.device.type != "cpu" else max(1, PREVIEW_CPU_CHUNK_ELEMENTS // width)
        for start in range(0, flat.shape[0], rows):
            chunk = flat[start:start + rows].to(torch.float32, copy=True)
            if weight_decay:
                chunk.mul_(1.0 - step * weight_decay)
            chunk.sub_(flat_side[start:start + rows], alpha=step)
            result[start:start + rows].copy_(chunk)
        return result.view(output.shape)


def gather_sequence(input: torch.Tensor, tp_group) -> torch.Tensor:
    """Sequence parallelism: this rank holds ``input``'s slice of the sequence (dim 0); the
    linear needs the whole sequence, gathered from the TP group in rank order."""
    world = dist.get_world_size(group=tp_group)
    gathered = torch.empty((input.shape[0] * world, *input.shape[1:]), dtype=input.dtype, device=input.device)
    dist.all_gather_into_tensor(gathered, input.contiguous(), group=tp_group)
    return gathered


class _SketchedLinearFunction(torch.autograd.Function):
    """``output = input @ weight^T (+ bias)``; the backward returns the input (and bias)
    gradient and, for the weight, only feeds the layer's :class:`LinearSketch`.

    ``anchor`` is a zero-size tensor that requires grad, so the backward runs even when
    neither the input nor the (frozen-to-autograd) weight requires grad.

    With ``sequence_parallel`` (column-parallel layers only, as in Megatron) the input is this
    rank's sequence slice: it is gathered over TP for the product, gathered again in the
    backward for the sketch rather than kept (Megatron's own trade: the whole sequence's input
    is never saved), and the input gradient is reduce-scattered back to the slice.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, anchor, sketch_owner, allreduce_dgrad, tp_group, sequence_parallel):
        ctx.save_for_backward(input, weight)
        ctx.sketch_owner = sketch_owner
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        ctx.sequence_parallel = sequence_parallel
        ctx.has_bias = bias is not None
        total_input = gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        total_input = gather_sequence(input, ctx.tp_group) if ctx.sequence_parallel else input
        grad_total_input = grad_output.matmul(weight)
        handle = None
        if ctx.sequence_parallel:
            # Each rank's sequence slice gets the TP sum of its rows' gradients.
            grad_input = torch.empty_like(input)
            handle = dist.reduce_scatter_tensor(grad_input, grad_total_input.contiguous(), group=ctx.tp_group,
                                                async_op=True)
        else:
            grad_input = grad_total_input
            if ctx.allreduce_dgrad:
                # Column-parallel: the input was replicated across TP, its gradient is the sum.
                handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        sketch = ctx.sketch_owner.logra_sketch
        if sketch is not None:
            sketch.accumulate(grad_2d, total_input.reshape(-1, total_input.shape[-1]))
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None, None


def sketched_linear(input, weight, bias, sketch_owner, allreduce_dgrad: bool, tp_group,
                    sequence_parallel: bool = False):
    """Apply the sketching linear function; ``sketch_owner.logra_sketch`` (may be None) is read
    at backward time, so the optimizer can attach or swap it between steps."""
    return _SketchedLinearFunction.apply(
        input, weight, bias, sketch_owner.logra_anchor, sketch_owner, allreduce_dgrad, tp_group, sequence_parallel
    )
