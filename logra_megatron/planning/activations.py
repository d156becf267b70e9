"""The transient memory of one training step on one rank, from :class:`PlanSettings` alone.

:func:`activation_bytes` replays, tensor by tensor, the allocations and frees of one step as the
code here runs it (``tools/benchmark_optimizer.py``'s step: ``lm_forward_backward`` through
Megatron's schedule, then the KL controller around the optimizer) and returns its peak beyond
what was live before the step, ``peak_step_bytes`` (what ``platform/memory.py:
AllocationTracker`` measures), with the bytes live at that moment by component.

**The microbatch**: packed (``PlanSettings.packed``, the trainer's default with SDPA attention),
one ``[1, t]`` sequence of the token budget (``--max-tokens-per-microbatch``; a row longer than
it alone), ``b = 1``, ``s = t``, whatever ``micro_batch_size x seq_length`` is; padded, ``b`` rows
of ``s = seq_length``. What packing changes (models/sdpa_attention.py ``_packed_forward``,
Megatron's ``_apply_rotary_pos_emb_thd``): SDPA runs once per row (tiles and per-call
gradients of a row of ``seq_length`` at most), its output pieces and logsumexp are saved beside
the context, which is a copy of their concatenation; each row's q/k/v slice gradient is a
zero-filled full-size tensor added into the accumulated one; the rotary frequencies are built
per token; the batch holds the packed ids, labels, positions and loss mask, and no ``s x s``
mask. The KL controller's probe is packed as the trainer packs it (rl/grpo.py ``probe_set``):
parts of whole rows up to the budget, each one forward-only ``[1, t]`` sequence
(:func:`probe_layout`); padded, ``micro_batch_size`` rows a pass.

The replay follows the code, not a rule of thumb (``T = b x s`` tokens of a microbatch, ``e`` the
bytes of the run's dtype, ``n``/``g``/``f``/``V`` the heads, kv heads, FFN width and padded
vocabulary on this TP rank, ``d`` the head dimension):

- **A layer's saved tensors** (Megatron's local layer spec): per RMSNorm the
  fp32 input (the residual itself in fp32, a copy in bf16), the fp32 normalized input, the output
  (``e``) and the fp32 ``1/rms`` per token; the rotated query, the key and value repeated to
  ``n`` heads (GQA; without GQA the key and the whole QKV output, of which the value is a view),
  the ``cos``/``sin`` tables of both rotations; the core attention's by ``--attention-backend``:
  ``unfused`` the softmax output ``b n s s`` in fp32 (plus its ``e`` copy in bf16, which the
  context product saves) and the contiguous context, ``sdpa`` (the default) the kernel's output,
  which is the context, and its fp32 logsumexp ``b n s`` (no ``s x s`` term); the SwiGLU MLP's
  fc1 output ``2f``, ``silu``, the linear half + offset and their product (``5 T f``). In fp32
  the residual stream is saved as the next norm's input; in bf16 the norm keeps its own fp32 copy
  and the residual lives only until the next residual add.
- **Sequence parallelism** (``--sequence-parallel``, TP > 1; megatron-core 0.16.1's
  tensor_parallel/layers.py and mappings.py, logra/sketch.py): outside the tensor-parallel
  regions each rank holds ``T / TP`` tokens (``Dims.sharded``): the embedding output (the lookup
  reduce-scattered, then cloned), every RMSNorm's tensors, the residual stream, the pipeline
  messages, the input gradients into those. A column-parallel linear (qkv, fc1, the output layer)
  all-gathers its input for the product but saves only the slice (Megatron's and LoGRA's alike),
  gathers it again in the backward for the weight gradient or sketch, and reduce-scatters its
  input gradient into a new slice; Megatron gathers into its kept global buffer
  (:func:`global_buffer_bytes`), LoGRA's sketching linears into tensors of their own (transient:
  the product in the forward, the whole backward). A row-parallel linear (proj, fc2) produces
  the whole sequence's partial sum and reduce-scatters it into a new slice; in the backward its
  output gradient is all-gathered first. q/k/v, attention, the MLP's intermediates and the logits
  are whole-sequence (heads, FFN and vocabulary split over TP as without SP). The model sets no
  dropout (models/build.py: attention and hidden dropout 0), so there are no masks to split.
  After the backward Megatron sums the norms' weight gradients over TP (one flattened fp32 copy).
- **Recomputation**: ``selective`` drops core attention's saved tensors (it keeps its inputs:
  q, the un-repeated key and the QKV output the value is a view of); ``full`` keeps only the
  input of each recomputed group (``uniform``) or of each of the first N layers (``block``), and
  the backward re-runs the group's forward (its saved tensors live while it is differentiated).
- **The last stage**: the final norm, the logits ``T x V`` (``e``), Megatron's vocab-parallel
  cross entropy on an fp32 copy (in place: its softmax becomes the logits' gradient), the
  per-token loss.
- **The schedule**: PP = 1 runs microbatches one at a time; 1F1B holds up to ``pp - stage``
  microbatches' saved tensors on stage ``stage``, plus each one's received input (and, on the
  CPU, where Megatron does not deallocate pipeline outputs, its sent output) until its backward.
  Under a virtual pipeline (``virtual_pipeline`` = V chunks per rank) the rank's passes are
  (microbatch, chunk) pairs in the order of Megatron's interleaved schedule
  (:func:`interleaved_order`): ``2 (pp - stage - 1) + (V - 1) N`` forwards of warm-up
  (:func:`interleaved_warmup`, ``N`` the trainer's microbatch group size, at least PP
  microbatches as the trainer fills a pass), each holding one chunk's saved tensors (its
  ``layers / (pp V)`` layers), its received input and sent output likewise; the embedding is
  chunk 0's of rank 0, the head the last chunk's of rank ``pp - 1``. Inputs the schedule receives
  one step ahead are counted from their forward (one message each, a hidden-state slice).
- **The backward**, op by op: the gradients each op allocates while the layer's saved tensors
  are freed as their last user runs (the peak is usually the output layer's backward, or an
  unfused layer's attention backward: gradients of the ``b n s s`` scores twice; SDPA's
  backward allocates the gradients of q, k and v and an fp32 scratch of the context's size).
- **The optimizer** (after the backward freed everything): torch's single-tensor AdamW on the
  CPU allocates ``sqrt(v)`` and its quotient per parameter (two of the largest parameter);
  clipping multiplies a copy per parameter; LoGRA reduces its sketches (a copy at ZeRO-1),
  takes their norm in fp64 chunks (two chunks of ``ops/budgets.py: NORM_CHUNK_ELEMENTS`` at
  most), and its AdamW direction ``U`` (two sketch-sized temporaries, ``U`` itself held to the
  commit), commits in row blocks (``SR_BLOCK_ELEMENTS`` with ``bf16-sr``).
- **The KL controller** (``probe``/``linear``): the dense optimizer's fp32 mains before and after
  its step (held from propose to commit), ``U``, and forward-only passes of the probe (its parts
  the microbatches of one schedule call): the ``s = 0`` logits' cache of every part, one part's
  ``new`` logits with its ``old`` ones restored, and the full-vocabulary KL's temporaries, taken
  over token chunks of ``KL_CHUNK_ELEMENTS`` logits (three fp32 chunk copies; fp64 for
  ``linear``), no saved activations.

Platforms. ``platform="cuda"`` is what a GPU with the local spec allocates; ``"cpu"`` is what the
CPU tracker records here: bf16 matrix products are computed in fp32 from widened inputs
(logra_megatron/platform/cpu_adapter.py: the widened inputs and the fp32 product are transient),
pipeline outputs are not deallocated after their send, and the tracker sees the norm probes
LoGRA draws anew each step but not the frees of the previous step's (their bytes count in
full); its SDPA kernel (aten's CPU flash attention) adds per-thread tiles of up to 256 x 512
scores, counted for one thread. With ``sdpa`` on a GPU the causal step runs the flash kernel
(bf16; the memory-efficient one in fp32, whose output is copied into the context at b > 1).
With Transformer Engine, RMSNorm saves only its input and ``1/rms`` and fused SwiGLU saves only
the fc1 output; this module models the local spec, which is what runs here.
"""

from dataclasses import dataclass
from typing import Dict

from logra_megatron.errors import UserError
from logra_megatron.layout import microbatch_group_size
from logra_megatron.models.config import resolve_attention_backend
from logra_megatron.ops.budgets import KL_CHUNK_ELEMENTS, NORM_CHUNK_ELEMENTS, SR_BLOCK_ELEMENTS, kl_chunk_rows
from logra_megatron.ops.multiples import ceil_div, round_up
from logra_megatron.planning import state as state_model
from logra_megatron.planning.settings import PlanSettings

FP32 = 4
FP64 = 8
INT64 = 8
PLATFORMS = ("cuda", "cpu")

COMPONENTS = ("saved_activations_bytes", "recompute_bytes", "logits_bytes", "forward_temporaries_bytes",
              "backward_temporaries_bytes", "pipeline_buffers_bytes", "batch_bytes", "optimizer_temporaries_bytes",
              "controller_copies_bytes", "proposal_update_bytes", "probe_bytes", "norm_probe_redraw_bytes")
"""What is live at the step's peak, by component (their sum is ``peak_step_bytes``)."""


@dataclass(frozen=True)
class Dims:
    """Shapes of one microbatch on one rank."""

    b: int
    s: int
    h: int
    n: int
    """Query heads on this TP rank."""
    g: int
    """Key/value heads on this TP rank."""
    d: int
    f: int
    """SwiGLU width on this TP rank (each half)."""
    vocab: int
    """Padded vocabulary rows on this TP rank."""
    e: int
    """Bytes per element of the run's dtype."""
    widened: bool
    """bf16 products computed in fp32 (the CPU adapter)."""
    segment: int = 0
    """Tokens of the longest sequence attention sees at once: ``s`` padded; packed (``b = 1``,
    ``s`` the token budget), the longest row (``seq_length``), as SDPA runs once per row."""
    sp: int = 1
    """Ranks the sequence is split over outside the tensor-parallel regions: TP under
    ``--sequence-parallel``, else 1."""

    @property
    def longest(self) -> int:
        return self.segment or self.s

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def sharded(self) -> int:
        """Tokens of this rank's slice of the sequence-parallel region (all of them without SP)."""
        return self.tokens // self.sp

    @property
    def scores(self) -> int:
        """Elements of one layer's attention scores ``b x n x s x s``."""
        return self.b * self.n * self.s * self.s


class Timeline:
    """Allocations and frees of named blocks in program order; keeps the peak and what was live
    at it, by component."""

    def __init__(self):
        self.live: Dict[object, tuple] = {}
        self.current = 0
        self.peak = 0
        self.at_peak: Dict[str, int] = {}
        self.phase = "step"
        self.phase_peaks: Dict[str, int] = {}

    def _check(self) -> None:
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            shown: Dict[str, int] = {}
            for nbytes, component in self.live.values():
                shown[component] = shown.get(component, 0) + nbytes
            self.at_peak = shown

    def alloc(self, key, nbytes: int, component: str) -> None:
        if key in self.live:
            raise AssertionError(f"block {key!r} allocated twice")
        if nbytes <= 0:
            return
        self.live[key] = (nbytes, component)
        self.current += nbytes
        self._check()

    def free(self, *keys) -> None:
        for key in keys:
            block = self.live.pop(key, None)
            if block is not None:
                self.current -= block[0]

    def rename(self, key, new_key) -> None:
        """The live block ``key`` is known as ``new_key`` from now on (same bytes, same component)."""
        if new_key in self.live:
            raise AssertionError(f"block {new_key!r} allocated twice")
        if key in self.live:
            self.live[new_key] = self.live.pop(key)

    def moment(self, nbytes: int, component: str) -> None:
        """A temporary that lives for one op (allocated and freed before the next)."""
        key = ("moment", len(self.live), self.current)
        self.alloc(key, nbytes, component)
        self.free(key)

    def has(self, key) -> bool:
        return key in self.live


class _Step:
    """One training step on the rank of pipeline stage ``stage`` (see the module docstring)."""

    def __init__(self, settings: PlanSettings, stage: int, platform: str):
        model, tp = settings.model, settings.tensor_parallel
        self.settings = settings
        self.platform = platform
        self.stage = stage
        # The rank holds the model's first chunk (the embedding) and its last (the head):
        # rank 0 and rank PP - 1, whatever the chunks.
        self.holds_first = stage == 0
        self.holds_last = stage == settings.pipeline_parallel - 1
        self.rank_layers = settings.model.layers // settings.pipeline_parallel
        self.chunk_keys = settings.virtual_pipeline is not None
        self._enter(0)
        e = settings.weight_bytes_per_element
        # Packed (the trainer's default): one [1, t] sequence of the token budget per microbatch,
        # whatever micro_batch_size x seq_length is; padded: b rows of s.
        self.packed = settings.packed
        rows, length = (1, settings.tokens_per_microbatch) if self.packed else (settings.micro_batch_size,
                                                                                settings.seq_length)
        self.dims = Dims(b=rows, s=length, h=model.hidden,
                         n=model.heads // tp, g=model.kv_heads // tp, d=model.kv_channels,
                         f=model.ffn_hidden // tp, vocab=model.padded_vocab(tp) // tp, e=e,
                         widened=settings.bf16 and platform == "cpu",
                         segment=min(settings.seq_length, length), sp=tp if settings.sequence_parallel else 1)
        self.sp = settings.sequence_parallel
        self.params = state_model.parameter_shapes(settings, stage)
        self.logra = settings.optimizer == "logra"
        self.sdpa = resolve_attention_backend(settings.attention_backend) == "sdpa"
        self.sketched = {p.name.split(".")[-2] for p in self.params if p.sketch_side is not None}
        self.timeline = Timeline()

    # --- helpers --------------------------------------------------------------------------------

    def _enter(self, chunk: int) -> None:
        """Run model chunk ``chunk`` of this rank from now on: ``first``/``last`` say whether it
        begins or ends the model (the embedding on rank 0's chunk 0, the head on rank PP - 1's
        last chunk), ``layers`` are its layers (the rank's all without a virtual pipeline)."""
        chunks = self.settings.chunks
        self.first = self.holds_first and chunk == 0
        self.last = self.holds_last and chunk == chunks - 1
        self.layers = self.rank_layers // chunks

    def _key(self, mb, chunk: int):
        """A microbatch's key in the timeline: under a virtual pipeline one per (microbatch, chunk)."""
        return (mb, chunk) if self.chunk_keys else mb

    def _product(self, tokens_in: int, weight_numel: int, tokens_out: int) -> None:
        """A bf16 product on the CPU: widened inputs and the fp32 product exist for one op."""
        if self.dims.widened:
            self.timeline.moment((tokens_in + weight_numel + tokens_out) * FP32, "forward_temporaries_bytes")

    def _linear_backward(self, key, rows_in: int, rows_out: int, width_in: int, width_out: int, slot: str,
                         column: bool = False) -> None:
        """Backward of a linear layer ``[T, in] -> [T, out]``: allocates the input gradient
        ``key``; the weight gradient (dense) or the sketch products (LoGRA) are temporaries.

        ``column`` (a column-parallel linear: qkv, fc1, the output layer) under sequence
        parallelism: the linear saved its input's sequence slice; the whole-sequence input
        gradient is reduce-scattered into a new slice-sized ``key`` (Megatron's
        ``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``sub_grad_input``; LoGRA's
        ``_SketchedLinearFunction.backward``: ``empty_like(input)``), allocated before the weight
        gradient or sketch is taken, and the whole-sequence one is freed when the backward
        returns. The weight gradient needs the gathered input again: Megatron gathers it into its
        global memory buffer (kept from the forward, :func:`global_buffer_bytes`), LoGRA's
        sketching linear into a new tensor (logra/sketch.py ``gather_sequence``) live for the
        whole backward."""
        tl, dims = self.timeline, self.dims
        tokens = dims.tokens
        weight = width_in * width_out
        scattered = self.sp and column
        comp = "backward_temporaries_bytes"
        if scattered and self._sketching(slot):
            tl.alloc(key + ("gathered",), tokens * width_in * dims.e, comp)
        if dims.widened:  # dgrad: grad_output and weight widened, fp32 product
            tl.moment((tokens * width_out + weight + tokens * width_in) * FP32, "backward_temporaries_bytes")
        if scattered:
            tl.alloc(key + ("whole",), tokens * width_in * dims.e, comp)
            tl.alloc(key, dims.sharded * width_in * dims.e, comp)
        else:
            tl.alloc(key, tokens * width_in * dims.e, "backward_temporaries_bytes")
        self._weight_gradient(rows_in, width_in, width_out, slot)
        if scattered:
            tl.free(key + ("whole",), key + ("gathered",))

    def _sketching(self, slot: str) -> bool:
        """Whether the linear in ``slot`` is LoGRA's sketching one (else Megatron's own)."""
        return self.logra and slot in self.sketched

    def _weight_gradient(self, rows_in: int, width_in: int, width_out: int, slot: str) -> None:
        """The weight gradient's temporaries (dense) or the sketch products' (LoGRA)."""
        tl, dims = self.timeline, self.dims
        tokens = dims.tokens
        weight = width_in * width_out
        if self.logra and slot in self.sketched:
            rank = self._rank_of(slot)
            probes = self._norm_probes()
            widened = (tokens * (width_in + width_out) * FP32) if dims.e != FP32 else 0
            tl.moment(widened + tokens * max(rank, probes) * FP32, "backward_temporaries_bytes")
        elif dims.widened:  # widened grad_output and input, the fp32 product; then its bf16 copy
            tl.moment(max((tokens * width_out + tokens * width_in + weight) * FP32, weight * (FP32 + dims.e)),
                      "backward_temporaries_bytes")
        else:  # the weight gradient, added into the fp32 gradient buffer
            tl.moment(weight * dims.e, "backward_temporaries_bytes")

    def _rank_of(self, slot: str) -> int:
        for param in self.params:
            if param.sketch_side is not None and param.name.split(".")[-2] == slot:
                return state_model.sketch_rank(self.settings, param)
        return 0

    def _norm_probes(self) -> int:
        return state_model.norm_probes(self.settings)

    # --- forward --------------------------------------------------------------------------------

    def _norm_forward(self, key, x_key, saved: bool) -> None:
        """RMSNorm of the residual ``x_key``: fp32 input (a copy in bf16), fp32 normalized
        input, output, fp32 1/rms; a squared-input temporary."""
        tl, dims = self.timeline, self.dims
        th = dims.sharded * dims.h  # a norm sees this rank's sequence slice under SP
        comp = "saved_activations_bytes" if saved else "forward_temporaries_bytes"
        if dims.e != FP32:
            tl.alloc(key + ("x32",), th * FP32, comp)
        tl.moment(th * FP32, "forward_temporaries_bytes")
        tl.alloc(key + ("rstd",), dims.sharded * FP32, comp)
        tl.alloc(key + ("normed",), th * FP32, comp)
        tl.alloc(key + ("out",), th * dims.e, comp)
        if not saved:
            tl.free(key + ("x32",), key + ("rstd",), key + ("normed",))

    def _layer_forward(self, mb, layer, x_key, saved: bool, attention_saved: bool):
        """One transformer layer; returns the key of its output. ``saved``: autograd keeps what
        the backward needs (False: no_grad, or inside a full-recompute checkpoint's first run);
        ``attention_saved``: False under selective recompute."""
        tl, d = self.timeline, self.dims
        e, T = d.e, d.tokens
        p = ("layer", mb, layer)
        comp = "saved_activations_bytes" if saved else "forward_temporaries_bytes"
        self._norm_forward(p + ("ln1",), x_key, saved)
        qkv = (d.n + 2 * d.g) * d.d
        self._gather_input(p + ("ln1", "gathered"), "linear_qkv")
        self._product(T * d.h, qkv * d.h, T * qkv)
        tl.alloc(p + ("qkv",), T * qkv * e, comp)
        tl.free(p + ("ln1", "gathered"))
        tl.free(p + ("ln1", "out")) if not saved else None
        # Rotary embedding of q and k: t*cos + rotate_half(t)*sin, then cat with the (empty) pass part.
        # Packed: Megatron's thd path (_apply_rotary_pos_emb_thd) first builds the restarted
        # positions' frequencies (fp32, one per token) for each of q and k.
        freqs = T * d.d * FP32 if self.packed else 0
        for name, heads in (("q", d.n), ("k", d.g)):
            tl.moment(3 * T * heads * d.d * e + freqs, "forward_temporaries_bytes")
            tl.alloc(p + ("rope", name), 2 * d.s * d.d * e, comp)
            tl.alloc(p + (name,), T * heads * d.d * e, comp)
        gqa = d.n > d.g
        core_saved = saved and attention_saved
        if gqa:
            tl.alloc(p + ("k_rep",), T * d.n * d.d * e, comp if core_saved else "forward_temporaries_bytes")
            tl.alloc(p + ("v_rep",), T * d.n * d.d * e, comp if core_saved else "forward_temporaries_bytes")
            if core_saved:  # the repeated copies are what the products save
                tl.free(p + ("k",), p + ("qkv",))
        if self.sdpa:
            self._sdpa_forward(p, comp, core_saved)
        else:
            self._unfused_forward(p, comp, core_saved)
        if not saved:
            tl.free(p + ("q",), p + ("k",), p + ("qkv",), p + ("rope", "q"), p + ("rope", "k"))
        self._product(T * d.n * d.d, d.h * d.n * d.d, T * d.h)
        tl.alloc(p + ("proj",), T * d.h * e, "forward_temporaries_bytes")
        self._scatter_output(p + ("proj",))
        if not saved:
            tl.free(p + ("ctx",))
        res1 = p + ("res1",)
        tl.alloc(res1, d.sharded * d.h * e, comp if (saved and e == FP32) else "forward_temporaries_bytes")
        tl.free(p + ("proj",))
        self._drop_residual(x_key, saved)
        self._norm_forward(p + ("ln2",), res1, saved)
        self._gather_input(p + ("ln2", "gathered"), "linear_fc1")
        self._product(T * d.h, 2 * d.f * d.h, 2 * T * d.f)
        tl.alloc(p + ("fc1",), 2 * T * d.f * e, comp)
        tl.free(p + ("ln2", "gathered"))
        if not saved:
            tl.free(p + ("ln2", "out"))
        tl.alloc(p + ("silu",), T * d.f * e, comp)
        tl.alloc(p + ("xlin",), T * d.f * e, comp)
        tl.alloc(p + ("act",), T * d.f * e, comp)
        if not saved:
            tl.free(p + ("fc1",), p + ("silu",), p + ("xlin",))
        self._product(T * d.f, d.h * d.f, T * d.h)
        tl.alloc(p + ("fc2",), T * d.h * e, "forward_temporaries_bytes")
        self._scatter_output(p + ("fc2",))
        if not saved:
            tl.free(p + ("act",))
        out = p + ("res2",)
        tl.alloc(out, d.sharded * d.h * e, comp if (saved and e == FP32) else "forward_temporaries_bytes")
        tl.free(p + ("fc2",))
        self._drop_residual(res1, saved)
        return out

    def _unfused_forward(self, p, comp: str, core_saved: bool) -> None:
        """Megatron's DotProductAttention: ``scores = baddbmm(q, k^T)`` (fp32 or e), the softmax in
        fp32 (and its e copy, which the context product saves), dropout(p=0) the identity."""
        tl, d = self.timeline, self.dims
        e, T = d.e, d.tokens
        self._product(2 * T * d.n * d.d, 0, d.scores)
        tl.alloc(p + ("scores",), d.scores * e, "forward_temporaries_bytes")
        if e != FP32:
            tl.alloc(p + ("scores32",), d.scores * FP32, "forward_temporaries_bytes")
        tl.alloc(p + ("probs32",), d.scores * FP32, comp if core_saved else "forward_temporaries_bytes")
        tl.free(p + ("scores",), p + ("scores32",))
        if e != FP32:
            tl.alloc(p + ("probs16",), d.scores * e, comp if core_saved else "forward_temporaries_bytes")
        self._product(d.scores + T * d.n * d.d, 0, T * d.n * d.d)
        tl.alloc(p + ("ctx_raw",), T * d.n * d.d * e, "forward_temporaries_bytes")
        tl.alloc(p + ("ctx",), T * d.n * d.d * e, comp)
        tl.free(p + ("ctx_raw",))
        if not core_saved:  # selective keeps core attention's inputs: q, k and qkv (v is its view)
            tl.free(p + ("probs32",), p + ("probs16",), p + ("k_rep",), p + ("v_rep",))

    def _sdpa_forward(self, p, comp: str, core_saved: bool) -> None:
        """scaled_dot_product_attention (causal, no mask): its output and the fp32 logsumexp, both
        saved by the kernel, and its tiles for the op. The output is the context linear_proj
        saves (one tensor, already laid out ``[s, b, heads, d]``), except from CUDA's
        memory-efficient kernel (fp32), whose ``[b, s, heads, d]`` output is copied at b > 1."""
        tl, d = self.timeline, self.dims
        context = d.tokens * d.n * d.d * d.e
        core = comp if core_saved else "forward_temporaries_bytes"
        if self.packed:
            self._packed_sdpa_forward(p, comp, core, core_saved)
            return
        if self._sdpa_copies_context():
            tl.alloc(p + ("out",), context, core)
        else:
            tl.alloc(p + ("ctx",), context, comp)
        tl.alloc(p + ("lse",), d.b * d.n * d.s * FP32, core)
        tl.moment(self._sdpa_tiles(backward=False), "forward_temporaries_bytes")
        if self._sdpa_copies_context():
            tl.alloc(p + ("ctx",), context, comp)
        if not core_saved:  # selective keeps core attention's inputs (and its output, the context)
            tl.free(p + ("out",), p + ("lse",), p + ("k_rep",), p + ("v_rep",))

    def _packed_sdpa_forward(self, p, comp: str, core: str, core_saved: bool) -> None:
        """SDPAttention's packed path (models/sdpa_attention.py ``_packed_forward``): SDPA once
        per row, each saving its output piece and logsumexp (together a context and ``n t``
        fp32), the pieces concatenated (``torch.cat``) and that ``[heads, t, d]`` copied into the
        ``[t, heads x d]`` context linear_proj saves (transpose, reshape): a context more saved
        than the padded path, and the concatenation for the op."""
        tl, d = self.timeline, self.dims
        context = d.tokens * d.n * d.d * d.e
        tl.alloc(p + ("out",), context, core)
        tl.alloc(p + ("lse",), d.n * d.tokens * FP32, core)
        tl.moment(self._sdpa_tiles(backward=False), "forward_temporaries_bytes")
        tl.alloc(p + ("cat",), context, "forward_temporaries_bytes")
        tl.alloc(p + ("ctx",), context, comp)
        tl.free(p + ("cat",))
        if not core_saved:
            tl.free(p + ("out",), p + ("lse",), p + ("k_rep",), p + ("v_rep",))

    def _sdpa_copies_context(self) -> bool:
        """Whether the context is a copy of SDPA's output: on CUDA in fp32 (no flash kernel; the
        memory-efficient one writes ``[b, s, heads, d]``) with more than one row per microbatch.
        The CPU kernel and CUDA's flash kernel write the query's layout."""
        return self.platform == "cuda" and self.dims.e == FP32 and self.dims.b > 1 and not self.packed

    def _sdpa_tiles(self, backward: bool) -> int:
        """Bytes of the CPU flash kernel's per-thread tiles (one thread; aten's
        FlashAttentionKernel.cpp: blocks of ``q_split`` queries by up to 512 keys; in the
        backward also the fp32 accumulation of the output gradient's product, one context of
        the run's dtype). CUDA's kernels tile in on-chip memory; their backward's fp32
        ``dq`` accumulator and ``softmax_d`` are what counts there."""
        d = self.dims
        # One kernel call's: packed, one row's (the longest); padded, the microbatch's.
        rows, length = (1, d.longest) if self.packed else (d.b, d.s)
        context = rows * length * d.n * d.d
        if self.platform == "cuda":
            return context * FP32 + rows * d.n * length * FP32 if backward else 0
        q_split = min(256 if length >= 768 else 64 if length >= 192 else 32, length)
        kv_split = min(512, length)
        block = q_split * kv_split
        reduced = d.e != FP32
        if backward:
            return context * d.e + (2 * block + q_split) * FP32 + (2 * block * d.e if reduced else 0)
        return (block + 2 * q_split + q_split * d.d) * FP32 + (block * d.e if reduced else 0)

    def _gather_input(self, key, slot: str) -> None:
        """A column-parallel linear's input under sequence parallelism: this rank's slice is
        all-gathered for the product and only the slice is saved for the backward (Megatron's
        ``LinearWithGradAccumulationAndAsyncCommunication.forward`` saves ``input``, LoGRA's
        ``_SketchedLinearFunction.forward`` too). Megatron gathers into its global memory buffer
        (``get_global_memory_buffer().get_tensor(..., "mpu")``: allocated by the first step and
        kept, :func:`global_buffer_bytes`); LoGRA's sketching linears into a new tensor that lives
        for the product (``key``, freed by the caller after the output exists)."""
        if self.sp and self._sketching(slot):
            d = self.dims
            self.timeline.alloc(key, d.tokens * d.h * d.e, "forward_temporaries_bytes")

    def _scatter_output(self, key) -> None:
        """A row-parallel linear's output under sequence parallelism: its whole-sequence partial
        sum ``key`` is reduce-scattered into a new slice (Megatron's
        ``reduce_scatter_to_sequence_parallel_region``, tensor_parallel/mappings.py
        ``_reduce_scatter_along_first_dim``: ``torch.empty`` of the slice), which is known as
        ``key`` from then on; without SP it is all-reduced in place."""
        if not self.sp:
            return
        tl, d = self.timeline, self.dims
        tl.alloc(key + ("slice",), d.sharded * d.h * d.e, "forward_temporaries_bytes")
        tl.free(key)
        tl.rename(key + ("slice",), key)

    def _gather_grad(self, key) -> None:
        """The backward of a row-parallel linear's reduce-scatter under sequence parallelism: the
        slice's gradient all-gathered into a new whole-sequence tensor ``key`` (mappings.py
        ``_gather_along_first_dim``), the linear's ``grad_output`` until its backward returns."""
        if self.sp:
            d = self.dims
            self.timeline.alloc(key, d.tokens * d.h * d.e, "backward_temporaries_bytes")

    def _drop_residual(self, key, saved: bool) -> None:
        """A residual tensor after its last forward use: kept when a norm saved it (fp32, grad
        mode), or when the schedule or a checkpoint holds it."""
        if key in self._held:
            return
        if saved and self.dims.e == FP32 and key[-1] in ("res1", "res2", "input"):
            return
        self.timeline.free(key)

    def _stage_forward(self, mb, grad: bool, x_key):
        """This stage's layers for microbatch ``mb``, by the recompute settings; returns the
        output key and the recompute groups (``(first, last, input key)``)."""
        settings = self.settings
        granularity = settings.recompute_granularity if grad else "none"
        groups = []
        x = x_key
        if granularity == "full":
            n = settings.recompute_num_layers
            if settings.recompute_method == "uniform":
                spans = [(start, min(start + n, self.layers)) for start in range(0, self.layers, n)]
            else:
                spans = [(index, index + 1) for index in range(self.layers)]
            for start, stop in spans:
                recomputed = settings.recompute_method == "uniform" or start < n
                if recomputed:
                    self._held.add(x)  # the checkpoint saves its input
                    self._retag(x, "recompute_bytes")
                    for layer in range(start, stop):
                        x = self._layer_forward(mb, layer, x, saved=False, attention_saved=False)
                    groups.append((start, stop, self._group_input(mb, start, x_key)))
                else:
                    x = self._layer_forward(mb, start, x, saved=True, attention_saved=True)
            return x, groups
        for layer in range(self.layers):
            x = self._layer_forward(mb, layer, x, saved=grad, attention_saved=granularity != "selective")
        return x, groups

    def _group_input(self, mb, start, x_key):
        """The tensor a recompute group starting at layer ``start`` keeps: the stage input or
        the previous layer's output."""
        return x_key if start == 0 else ("layer", mb, start - 1, "res2")

    def _retag(self, key, component: str) -> None:
        block = self.timeline.live.get(key)
        if block is not None:
            self.timeline.live[key] = (block[0], component)

    def _embedding_forward(self, mb, grad: bool):
        tl, d = self.timeline, self.dims
        T = d.tokens
        key = ("emb", mb)
        if self.settings.tensor_parallel > 1:  # the masked ids (int64) and the mask, saved
            tl.alloc(key + ("ids",), T * (INT64 + 1), "saved_activations_bytes" if grad else "forward_temporaries_bytes")
        tl.alloc(key + ("lookup",), T * d.h * d.e, "forward_temporaries_bytes")
        if self.sp:
            # Megatron's reduce_scatter_embeddings (no learned positions): the lookup laid out
            # [s, b, h] (a copy at b > 1), reduce-scattered into this rank's slice, which
            # LanguageModelEmbedding clones (clone_scatter_output_in_embedding) into the stage input.
            if d.b > 1:
                tl.alloc(key + ("sbh",), T * d.h * d.e, "forward_temporaries_bytes")
                tl.free(key + ("lookup",))
                tl.rename(key + ("sbh",), key + ("lookup",))
            tl.alloc(key + ("slice",), d.sharded * d.h * d.e, "forward_temporaries_bytes")
            tl.free(key + ("lookup",))
            tl.rename(key + ("slice",), key + ("lookup",))
        x = ("layer", mb, -1, "input")
        tl.alloc(x, d.sharded * d.h * d.e,
                 "saved_activations_bytes" if grad and d.e == FP32 else "forward_temporaries_bytes")
        tl.free(key + ("lookup",))
        if not grad:
            tl.free(key + ("ids",))
        return x

    def _head_forward(self, mb, x, grad: bool):
        """Final norm, output layer and (grad mode) the cross entropy; the logits' keys."""
        tl, d = self.timeline, self.dims
        T = d.tokens
        comp = "logits_bytes"
        self._norm_forward(("head", mb, "ln"), x, grad)
        self._drop_residual(x, grad)
        self._gather_input(("head", mb, "gathered"), "output_layer")
        self._product(T * d.h, d.vocab * d.h, T * d.vocab)
        logits = ("head", mb, "logits")
        tl.alloc(logits, T * d.vocab * d.e, comp)
        tl.free(("head", mb, "gathered"))
        if not grad:
            tl.free(("head", mb, "ln", "out"))
            return logits
        if d.e != FP32:  # the cross entropy works on an fp32 copy (saved, in place)
            tl.alloc(("head", mb, "logits32"), T * d.vocab * FP32, comp)
            tl.free(logits)
        ce = ("head", mb, "ce")
        tl.alloc(ce, T * (INT64 + 1 + 2 * FP32) + (T * FP32 if self.settings.tensor_parallel > 1 else 0), comp)
        return ce

    # --- backward -------------------------------------------------------------------------------

    def _norm_backward(self, key, grad_in, out_key) -> None:
        """RMSNorm backward: fp32 temporaries, the input gradient ``out_key``; frees the norm's
        saved tensors."""
        tl, d = self.timeline, self.dims
        th = d.sharded * d.h
        tl.moment(2 * th * FP32, "backward_temporaries_bytes")
        if d.e != FP32:
            tl.moment(th * FP32, "backward_temporaries_bytes")
        tl.alloc(out_key, th * d.e, "backward_temporaries_bytes")
        tl.free(grad_in, key + ("x32",), key + ("rstd",), key + ("normed",))

    def _layer_backward(self, mb, layer, grad_key, x_key, selective: bool = False):
        """Backward of one layer whose saved tensors are live (``x_key``: its input); returns
        its input gradient. ``selective``: core attention is re-run first (its scores, softmax
        and repeated key and value exist again until their backward)."""
        tl, d = self.timeline, self.dims
        e, T = d.e, d.tokens
        p = ("layer", mb, layer)
        g = ("grad", mb, layer)
        comp = "backward_temporaries_bytes"
        # MLP
        self._gather_grad(g + ("fc2_out",))
        self._linear_backward(g + ("act",), T, T, d.f, d.h, "linear_fc2")
        tl.free(g + ("fc2_out",), p + ("act",))
        tl.alloc(g + ("silu",), T * d.f * e, comp)
        tl.alloc(g + ("xlin",), T * d.f * e, comp)
        tl.free(g + ("act",), p + ("silu",), p + ("xlin",))
        tl.moment(T * d.f * FP32 * (2 if e != FP32 else 1), comp)  # silu backward's fp32 terms
        tl.alloc(g + ("xglu",), T * d.f * e, comp)
        tl.free(g + ("silu",), p + ("fc1",))
        tl.alloc(g + ("fc1",), 2 * T * d.f * e, comp)
        tl.free(g + ("xglu",), g + ("xlin",))
        self._linear_backward(g + ("ln2",), T, T, d.h, 2 * d.f, "linear_fc1", column=True)
        tl.free(g + ("fc1",), p + ("ln2", "out"))
        self._norm_backward(p + ("ln2",), g + ("ln2",), g + ("ln2x",))
        tl.free(p + ("res1",))
        tl.alloc(g + ("res1",), d.sharded * d.h * e, comp)  # residual grad: the sum of both paths
        tl.free(g + ("ln2x",), grad_key)
        # attention
        self._gather_grad(g + ("proj_out",))
        self._linear_backward(g + ("ctx",), T, T, d.n * d.d, d.h, "linear_proj")
        tl.free(g + ("proj_out",))
        if self.sdpa:
            self._sdpa_backward(p, g, selective)
        else:
            tl.free(p + ("ctx",))
            self._unfused_backward(p, g, selective)
        if d.n > d.g:
            tl.alloc(g + ("k",), T * d.g * d.d * e, comp)
            tl.alloc(g + ("v",), T * d.g * d.d * e, comp)
            tl.free(g + ("k_rep",), g + ("v_rep",))
        else:
            tl.free(p + ("qkv",))
        for name, heads in (("q", d.n), ("k", d.g)):
            tl.moment(2 * T * heads * d.d * e, comp)
            tl.free(p + ("rope", name))
        tl.free(p + ("k",), p + ("qkv",))
        qkv = (d.n + 2 * d.g) * d.d
        tl.alloc(g + ("qkv",), T * qkv * e, comp)
        tl.free(g + ("q",), g + ("k",), g + ("v",), g + ("k_rep",), g + ("v_rep",))
        self._linear_backward(g + ("ln1",), T, T, d.h, qkv, "linear_qkv", column=True)
        tl.free(g + ("qkv",), p + ("ln1", "out"))
        self._norm_backward(p + ("ln1",), g + ("ln1",), g + ("ln1x",))
        if x_key not in self._held:
            tl.free(x_key)
        out = g + ("input",)
        tl.alloc(out, d.sharded * d.h * e, comp)
        tl.free(g + ("ln1x",), g + ("res1",))
        return out

    def _unfused_backward(self, p, g, selective: bool) -> None:
        """DotProductAttention's backward (its forward re-run first under selective recompute):
        the ``b n s s`` gradients of the probabilities and the scores, then of q and the
        repeated key and value."""
        tl, d = self.timeline, self.dims
        e, T = d.e, d.tokens
        comp = "backward_temporaries_bytes"
        if selective:
            redo = "recompute_bytes"
            if d.n > d.g:
                tl.alloc(p + ("k_rep",), T * d.n * d.d * e, redo)
                tl.alloc(p + ("v_rep",), T * d.n * d.d * e, redo)
            self._product(2 * T * d.n * d.d, 0, d.scores)
            tl.moment(d.scores * (e + (FP32 if e != FP32 else 0)), redo)
            tl.alloc(p + ("probs32",), d.scores * FP32, redo)
            if e != FP32:
                tl.alloc(p + ("probs16",), d.scores * e, redo)
            self._product(d.scores + T * d.n * d.d, 0, T * d.n * d.d)
            tl.moment(T * d.n * d.d * e, redo)
        if d.widened:
            tl.moment((d.scores + 3 * T * d.n * d.d) * FP32 + d.scores * FP32, comp)
        tl.alloc(g + ("probs",), d.scores * e, comp)
        tl.alloc(g + ("v_rep",), T * d.n * d.d * e, comp)
        tl.free(g + ("ctx",), p + ("probs16",), p + ("v_rep",))
        if e != FP32:
            tl.alloc(g + ("probs32",), d.scores * FP32, comp)
            tl.free(g + ("probs",))
        tl.alloc(g + ("scores",), d.scores * FP32, comp)
        tl.free(g + ("probs",), g + ("probs32",), p + ("probs32",))
        tl.alloc(g + ("masked",), d.scores * FP32, comp)  # masked_fill_'s backward
        tl.free(g + ("scores",))
        if e != FP32:
            tl.alloc(g + ("scores16",), d.scores * e, comp)
            tl.free(g + ("masked",))
        if d.widened:
            tl.moment((2 * T * d.n * d.d + 2 * d.scores + 2 * T * d.n * d.d) * FP32, comp)
        tl.alloc(g + ("q",), T * d.n * d.d * e, comp)
        tl.alloc(g + ("k_rep",), T * d.n * d.d * e, comp)
        tl.free(g + ("masked",), g + ("scores16",), p + ("q",), p + ("k_rep",))

    def _sdpa_backward(self, p, g, selective: bool) -> None:
        """SDPA's backward (its forward re-run first under selective recompute): the gradients
        of q and the repeated key and value, the kernel's scratch; then its saved output (the
        context, unless copied), logsumexp and inputs are released."""
        tl, d = self.timeline, self.dims
        context = d.tokens * d.n * d.d * d.e
        comp = "backward_temporaries_bytes"
        if selective or self._sdpa_copies_context():  # the context only linear_proj needed
            tl.free(p + ("ctx",))
        if selective:
            redo = "recompute_bytes"
            if d.n > d.g:
                tl.alloc(p + ("k_rep",), context, redo)
                tl.alloc(p + ("v_rep",), context, redo)
            tl.alloc(p + ("out",), context, redo)
            tl.alloc(p + ("lse",), d.b * d.n * d.s * FP32, redo)
            tl.moment(self._sdpa_tiles(backward=False), redo)
            if self.packed:  # the re-run's concatenation and context copy
                tl.moment(2 * context, redo)
            if self._sdpa_copies_context():  # the re-run's context, which nothing uses
                tl.moment(context, redo)
        tl.alloc(g + ("q",), context, comp)
        tl.alloc(g + ("k_rep",), context, comp)
        tl.alloc(g + ("v_rep",), context, comp)
        if self.packed:
            # Per row: the kernel's gradients of its q, k and v slices, and each slice's
            # backward (SliceBackward) a zero-filled full-size gradient added into the
            # accumulated one; one row at a time.
            piece = d.longest * d.n * d.d * d.e
            tl.moment(3 * piece + context + self._sdpa_tiles(backward=True), comp)
        else:
            tl.moment(self._sdpa_tiles(backward=True), comp)
        tl.free(g + ("ctx",), p + ("ctx",), p + ("out",), p + ("lse",), p + ("q",), p + ("k_rep",), p + ("v_rep",))

    def _input_of(self, mb, layer, stage_input):
        return stage_input if layer == 0 else ("layer", mb, layer - 1, "res2")

    def _stage_backward(self, mb, groups, grad_key, stage_input):
        """Backward through this stage's layers (re-running recomputed groups first)."""
        selective = self.settings.recompute_granularity == "selective"
        spans = {start: stop for start, stop, _ in groups}
        layer = self.layers - 1
        while layer >= 0:
            start = next((s for s, stop in spans.items() if s <= layer < stop), None)
            if start is not None:
                first_input = next(key for s, _, key in groups if s == start)
                x = first_input
                for index in range(start, spans[start]):
                    x = self._layer_forward(mb, index, x, saved=True, attention_saved=True)
                for index in range(spans[start] - 1, start - 1, -1):
                    grad_key = self._layer_backward(mb, index, grad_key, self._input_of(mb, index, stage_input))
                if x not in self._held:  # the re-run's output: only its gradient was needed
                    self.timeline.free(x)
                self._release_input(first_input)
                layer = start - 1
                continue
            grad_key = self._layer_backward(mb, layer, grad_key, self._input_of(mb, layer, stage_input), selective)
            layer -= 1
        return grad_key

    def _release_input(self, key) -> None:
        """A recompute group's input after the group's backward (the stage input stays with
        the schedule)."""
        if key[-1] == "input" and not self.first:
            return
        self._held.discard(key)
        self.timeline.free(key)

    def _head_backward(self, mb, ce_key, x_key):
        """Cross entropy's gradient (in place on its softmax), the output layer's and the final
        norm's backward; returns the gradient into the last layer."""
        tl, d = self.timeline, self.dims
        T = d.tokens
        comp = "backward_temporaries_bytes"
        tl.moment(T * FP32 * 2, comp)  # the loss's gradient and mask products
        logits = ("head", mb, "logits32") if d.e != FP32 else ("head", mb, "logits")
        grad_logits = logits
        if d.e != FP32:  # the fp32 gradient cast back to the logits' dtype
            grad_logits = ("grad", mb, "logits")
            tl.alloc(grad_logits, T * d.vocab * d.e, comp)
            tl.free(logits)
        tl.free(ce_key)
        self._linear_backward(("grad", mb, "head"), T, T, d.h, d.vocab, "output_layer", column=True)
        tl.free(grad_logits, ("head", mb, "ln", "out"))
        self._norm_backward(("head", mb, "ln"), ("grad", mb, "head"), ("grad", mb, "head_in"))
        if x_key not in self._held:
            tl.free(x_key)
        return ("grad", mb, "head_in")

    def _embedding_backward(self, mb, grad_key) -> None:
        tl, d = self.timeline, self.dims
        if self.sp:  # the reduce-scatter's backward: the slice's gradient all-gathered
            tl.alloc(("grad", mb, "emb"), d.tokens * d.h * d.e, "backward_temporaries_bytes")
            tl.free(grad_key)
        if not (self.logra and "word_embeddings" in self.sketched):
            tl.moment(d.vocab * d.h * d.e, "backward_temporaries_bytes")  # the dense weight gradient
        tl.free(grad_key, ("emb", mb, "ids"), ("grad", mb, "emb"))

    # --- one microbatch, and the schedule ---------------------------------------------------------

    def forward_microbatch(self, mb, chunk: int = 0) -> None:
        """Microbatch ``mb`` through model chunk ``chunk`` of this rank (its only one without a
        virtual pipeline); its saved tensors stay until :meth:`backward_microbatch`."""
        self._enter(chunk)
        mb = self._key(mb, chunk)
        tl, d = self.timeline, self.dims
        T = d.tokens
        if self.first:
            x = self._embedding_forward(mb, grad=True)
        else:  # the received activation, held by the schedule until this microbatch's backward
            # (a sequence slice under SP: Megatron's p2p shapes are seq_length / TP)
            x = ("layer", mb, -1, "input")
            tl.alloc(x, d.sharded * d.h * d.e, "pipeline_buffers_bytes")
            self._held.add(x)
        out, groups = self._stage_forward(mb, grad=True, x_key=x)
        if self.last:
            ce = self._head_forward(mb, out, grad=True)
            self._pending[mb] = (groups, (ce, out), x)
        else:
            if self.platform == "cuda":  # Megatron deallocates a sent output's data
                tl.free(out)
            else:
                # Kept by the schedule until this microbatch's backward: from here on it is the
                # sent tensor, not the layer's output, which a full-recompute group ending at the
                # stage's last layer allocates anew when its backward re-runs that layer.
                self._retag(out, "pipeline_buffers_bytes")
                sent = ("sent", mb)
                tl.rename(out, sent)
                out = sent
            self._pending[mb] = (groups, out, x)

    def backward_microbatch(self, mb, chunk: int = 0) -> None:
        self._enter(chunk)
        mb = self._key(mb, chunk)
        tl, d = self.timeline, self.dims
        groups, out, x = self._pending.pop(mb)
        if self.last:
            grad = self._head_backward(mb, *out)
        else:
            grad = ("recv_grad", mb)
            tl.alloc(grad, d.sharded * d.h * d.e, "pipeline_buffers_bytes")
        grad = self._stage_backward(mb, groups, grad, x)
        if not self.last:
            tl.free(out)
        self._held.discard(x)
        tl.free(x)
        if self.first:
            self._embedding_backward(mb, grad)
        else:  # sent to the previous stage, then dropped
            tl.free(grad)

    def forward_backward(self) -> None:
        settings = self.settings
        tl, d = self.timeline, self.dims
        self._held = set()
        self._pending = {}
        per_replica = settings.global_batch_size // settings.data_parallel
        microbatches = settings.num_microbatches
        if settings.virtual_pipeline is None:
            # 1F1B's steady state repeats itself: past the warm-up and one steady step nothing new
            # can peak, so longer runs of microbatches are not replayed (a 64-microbatch plan of a
            # 32B model would otherwise take seconds per stage).
            microbatches = min(microbatches, settings.pipeline_parallel - self.stage + 1)
        else:
            order = interleaved_order(settings, self.stage)
            microbatches = min(microbatches, 1 + max(mb for _, mb, _ in order))
        tl.phase = "forward_backward"
        # lm_forward_backward: inputs and labels (int64) of the replica's batch, its loss mask,
        # the causal mask.
        if self.packed:  # each packed microbatch's inputs, labels, positions (int64), loss mask; no mask
            tl.alloc("batch", microbatches * d.tokens * (3 * INT64 + FP32), "batch_bytes")
        else:
            tl.alloc("batch", per_replica * d.s * (2 * INT64 + FP32) + d.s * d.s, "batch_bytes")
        if self.sdpa and not self.packed:  # SDPAttention's test of that mask against a causal one, once per step
            tl.moment(d.s * d.s, "forward_temporaries_bytes")
        if settings.pipeline_parallel == 1:
            for mb in range(microbatches):
                self.forward_microbatch(mb)
                self.backward_microbatch(mb)
        elif settings.virtual_pipeline is not None:
            for kind, mb, chunk in order:
                (self.forward_microbatch if kind == "F" else self.backward_microbatch)(mb, chunk)
            self._enter(0)
        else:
            warmup = min(settings.pipeline_parallel - self.stage - 1, microbatches)
            for mb in range(warmup):
                self.forward_microbatch(mb)
            for index in range(microbatches - warmup):
                self.forward_microbatch(warmup + index)
                self.backward_microbatch(index)
            for mb in range(microbatches - warmup, microbatches):
                self.backward_microbatch(mb)
        if self.sp:
            # finalize_model_grads sums the sequence-parallel norms' weight gradients over TP
            # (distributed/finalize_model_grads.py: one flattened fp32 copy of their main_grads).
            norms = 2 * self.rank_layers + (1 if self.holds_last else 0)
            tl.moment(norms * d.h * FP32, "backward_temporaries_bytes")
        tl.free("batch")

    # --- the optimizer and the KL controller ------------------------------------------------------

    def _dense_params(self):
        return [p for p in self.params if p.sketch_side is None]

    def _largest_main(self) -> int:
        """Elements of the largest dense parameter (its shard under the distributed optimizer)."""
        dense = self._dense_params()
        if not dense:
            return 0
        largest = max(p.numel for p in dense)
        if self.settings.distributed_optimizer:
            largest = ceil_div(largest, self.settings.data_parallel)
        return largest

    def _dense_step(self) -> None:
        """Megatron's optimizer: the inf/NaN check (a bool per element of a gradient, one at a
        time), clipping (a scaled copy per gradient), torch's single-tensor AdamW (``sqrt(v)`` and
        the quotient per parameter)."""
        tl = self.timeline
        largest = self._largest_main()
        comp = "optimizer_temporaries_bytes"
        tl.moment(largest, comp)
        tl.moment(largest * FP32, comp)
        tl.moment(2 * largest * FP32, comp)

    def _logra_propose(self) -> None:
        """LoGRA's propose up to ``U``: the ZeRO-1 slice of the reduced sketches (a copy), the
        fp64 norm, the update rule's temporaries; ``U`` stays until the commit."""
        tl = self.timeline
        settings = self.settings
        comp = "optimizer_temporaries_bytes"
        full = state_model.proposal_update_bytes(settings, self.stage) // FP32
        dp = settings.data_parallel
        zero1 = settings.distributed_optimizer
        sliced = zero1 and dp > 1
        local = full // dp if sliced else full
        if zero1:
            tl.alloc("sketch_slice", local * FP32, comp)
        tl.moment(local, comp)  # isfinite
        tl.moment(norm_chunk_bytes(local), comp)  # ops/norms.py: the sketch norm in fp64 chunks
        probes = sum(self._norm_probes() * (p.shape[0] if p.sketch_side == "right" else p.shape[1])
                     for p in self.params if p.sketch_side is not None)
        tl.moment(norm_chunk_bytes(probes), comp)
        self._dense_step()
        # The update rule's own temporaries, as it declares them (logra/update_rules.py): a peak
        # before U, and what is still live when U is allocated (Adam's denominator).
        lines = state_model.sketch_lines(settings, self.stage)
        peak, held = state_model.update_rule_temporaries(settings, local, lines)
        tl.moment(peak, comp)
        tl.alloc("rule_held", held, comp)
        tl.alloc("update_local", local * FP32, "proposal_update_bytes")
        tl.free("rule_held")
        if sliced:
            tl.alloc("update", full * FP32, "proposal_update_bytes")
            tl.free("update_local")
        tl.free("sketch_slice")

    def _commit(self) -> None:
        """Row blocks through the master mode (logra/masters.py ``block_rows``): ``none``, an
        fp32 block of at most a sketch's elements; ``bf16-sr``, blocks of ``SR_BLOCK_ELEMENTS``
        (whole rows, at least one) holding the fp32 values and three int64 tensors (the element
        index, the random bits, the bit pattern: ops/rounding.py). The proposal is dropped."""
        tl = self.timeline
        if self.logra and self.settings.bf16 and self.settings.logra.master in ("bf16-sr", "none"):
            sketched = [p for p in self.params if p.sketch_side is not None]
            if self.settings.logra.master == "bf16-sr":
                tl.moment(sr_commit_bytes([p.shape for p in sketched]), "optimizer_temporaries_bytes")
            else:
                block = max((max(1, state_model.sketched_weight(self.settings, p).sketch_numel
                                 // p.shape[1]) * p.shape[1] for p in sketched), default=0)
                tl.moment(block * FP32, "optimizer_temporaries_bytes")
        tl.free("update", "update_local", "copies")

    def _probe_pass(self) -> None:
        """One forward-only pass of a probe part (:func:`probe_layout`): padded, ``b`` rows of
        ``seq_length + 1`` tokens; packed, as the trainer packs it (rl/grpo.py ``probe_set``), one
        ``[1, t]`` sequence of whole rows (SDPA per row, as the training microbatches); no saved
        activations, layer by layer."""
        tl = self.timeline
        saved_dims = self.dims
        rows, _ = probe_layout(self.settings)
        length = probe_row_tokens(self.settings)
        # Under SP the sequence a pass splits over TP is taken up to a multiple of TP (the
        # padding rl/grpo.py gives training microbatches; none where it is already one).
        whole = (lambda tokens: round_up(tokens, saved_dims.sp))
        if self.settings.packed:
            self.dims = Dims(**{**saved_dims.__dict__, "b": 1, "s": whole(rows * length), "segment": length})
        else:
            self.dims = Dims(**{**saved_dims.__dict__, "b": rows, "s": whole(length), "segment": 0})
        saved_packed, self.packed = self.packed, self.settings.packed
        # Several chunks: the interleaved schedule runs at least PP microbatches, the probe part
        # and fillers (training/lm.py pipeline_pass), chunk after chunk (one group of PP); a
        # filler's logits are dropped by its loss.
        passes = self.settings.pipeline_parallel if self.settings.chunks > 1 else 1
        try:
            d = self.dims
            key = ("probe", self._probe_count)
            self._probe_count += 1
            for chunk in range(self.settings.chunks):
                self._enter(chunk)
                for index in range(passes):
                    part = key if index == 0 else key + ("filler", index)
                    if self.first:
                        x = self._embedding_forward(part, grad=False)
                    else:
                        x = ("layer", self._key(part, chunk), -1, "input")
                        tl.alloc(x, d.sharded * d.h * d.e, "probe_bytes")
                    for layer in range(self.layers):
                        x = self._layer_forward(self._key(part, chunk), layer, x, saved=False, attention_saved=False)
                        self._preview_side_paths()
                    if self.last:
                        logits = self._head_forward(part, x, grad=False)
                        tl.free(x)
                        if index:
                            tl.free(logits)
                        else:
                            self._retag(logits, "probe_bytes")
                            self._probe_logits.append(logits)
                    else:
                        tl.free(x)
        finally:
            self._enter(0)
            self.dims = saved_dims
            self.packed = saved_packed

    def _preview_side_paths(self) -> None:
        """LoGRA's preview inside a sketching layer: ``(X Q) U^T`` or ``(X U^T) P^T`` and the
        fp32 output it is added to."""
        if not self.logra:
            return
        d = self.dims
        widest = max(2 * d.f, (d.n + 2 * d.g) * d.d, d.h)
        self.timeline.moment(3 * d.tokens * widest * FP32, "probe_bytes")

    def _probe_kl(self) -> None:
        """The full-vocabulary KL of two logits slices (ops/vocab_parallel.py ``masked_kl_sum``,
        ``masked_half_variance_sum``), token chunk by token chunk of ``KL_CHUNK_ELEMENTS``
        logits: three chunk-sized temporaries, fp32 (``probe``: both log-softmaxes, then the
        product) or fp64 (``linear``: the weights, the difference, a product)."""
        if not self.holds_last:
            return
        d = self.dims
        rows, _ = probe_layout(self.settings)
        tokens = rows * probe_row_tokens(self.settings)
        self.timeline.moment(kl_reduction_bytes(tokens, d.vocab, self.settings.kl_control), "probe_bytes")

    def _cached_probe(self, parts: int) -> None:
        """The forecast (training/kl_control.py ``base_logits``, ``kl``, ``linear_kl``): every
        part's ``s = 0`` logits are computed once and a copy of them (the positions the mask
        counts; here all, the most a part can count) is held through the forecasts; a forecast
        then runs each part's ``new`` logits and, as they come out, takes the KL against the
        part's ``old`` ones (``probe``: a zero-filled part of the logits' size restored from the
        cache; ``linear``: the ``new`` logits at the counted positions, as large at most),
        freeing both before the next part."""
        tl, d = self.timeline, self.dims
        rows, _ = probe_layout(self.settings)
        size = rows * probe_row_tokens(self.settings) * d.vocab * d.e if self.holds_last else 0
        for index in range(parts):
            self._probe_pass()
            if self.holds_last:
                tl.alloc(("probe_cache", index), size, "probe_bytes")
                tl.free(self._probe_logits.pop())
        for _ in range(parts):
            self._probe_pass()
            if self.holds_last:
                tl.alloc("probe_restored", size, "probe_bytes")
            self._probe_kl()
            tl.free("probe_restored", *self._probe_logits)
            self._probe_logits.clear()
        tl.free(*(("probe_cache", index) for index in range(parts)))

    def controller(self) -> None:
        """The step after the backward: plain optimizer step (``off``), or propose -> probe
        forecasts -> commit."""
        settings, tl = self.settings, self.timeline
        tl.phase = "optimizer"
        mode = settings.kl_control
        if mode == "off":
            if self.logra:
                self._logra_propose()
                self._commit()
            else:
                self._dense_step()
            return
        # propose: the dense optimizer's mains copied before and after its step
        copies = state_model.proposal_copies_bytes(state_model.dense_main_numel(settings, self.stage))
        before = copies // 2
        tl.alloc("copies_before", before, "controller_copies_bytes")
        if self.logra:
            self._logra_propose()
        else:
            self._dense_step()
        tl.alloc("copies_after", copies - before, "controller_copies_bytes")
        tl.phase = "controller"
        self._probe_count = 0
        self._probe_logits = []
        _, parts = probe_layout(settings)
        self._cached_probe(parts)  # probe and linear alike: the s = 0 cache, one moved pass
        for logits in self._probe_logits:
            tl.free(logits)
        tl.phase = "optimizer"
        self._commit()
        tl.free("copies_before", "copies_after")

    def norm_probe_redraw(self) -> None:
        """``zero_grad`` draws this step's norm probes ``(I - Q Q^T) Omega``: three temporaries of
        a probe's size per weight, one at a time; the new probes replace last step's. The CPU
        tracker cannot see the old ones freed (allocated before it started): all new ones count."""
        if not (self.logra and self._norm_probes()):
            return
        tl = self.timeline
        sizes = [state_model.sketched_weight(self.settings, p).probe_direction_numel(self._norm_probes()) * FP32
                 for p in self.params if p.sketch_side is not None]
        tl.phase = "zero_grad"
        if self.platform == "cpu":
            tl.alloc("norm_probes", sum(sizes), "norm_probe_redraw_bytes")
            tl.moment(2 * max(sizes), "norm_probe_redraw_bytes")
        else:
            tl.moment(3 * max(sizes), "norm_probe_redraw_bytes")


def activation_bytes(settings: PlanSettings, stage: int, platform: str = "cuda") -> Dict[str, int]:
    """The step's transient memory on one rank of pipeline stage ``stage`` (any TP rank; the
    busiest DP rank): ``peak_step_bytes``, the components live at that peak (:data:`COMPONENTS`),
    the peak of each phase (``<phase>_peak_bytes``: forward_backward, optimizer, controller) and
    ``microbatches_in_flight``. ``platform``: ``cuda`` (a GPU, local spec) or ``cpu`` (what the
    CPU tracker records here; see the module docstring)."""
    if platform not in PLATFORMS:
        raise UserError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    state_model.check_settings(settings)
    _check_recompute(settings)
    step = _Step(settings, stage, platform)
    step.norm_probe_redraw()
    step.forward_backward()
    step.controller()
    timeline = step.timeline
    result = {component: timeline.at_peak.get(component, 0) for component in COMPONENTS}
    result["peak_step_bytes"] = timeline.peak
    for phase in ("forward_backward", "optimizer", "controller"):
        result[f"{phase}_peak_bytes"] = timeline.phase_peaks.get(phase, 0)
    if settings.virtual_pipeline is None:
        result["microbatches_in_flight"] = min(settings.pipeline_parallel - stage, settings.num_microbatches)
    else:  # (microbatch, chunk) pairs: the warm-up's forwards and the steady state's next one
        result["microbatches_in_flight"] = min(interleaved_warmup(settings, stage) + 1,
                                               settings.pipeline_microbatches * settings.chunks)
    return result


def _group_size(settings: PlanSettings) -> int:
    """The group size the schedule runs with: the trainer's under several chunks; one chunk
    keeps Megatron's default, PP (``model_parallel_config.py``)."""
    if settings.chunks > 1:
        return microbatch_group_size(settings.pipeline_microbatches, settings.pipeline_parallel)
    return settings.pipeline_parallel


def interleaved_warmup(settings: PlanSettings, stage: int, microbatches: int = None) -> int:
    """Forward (microbatch, chunk) passes before the first backward on pipeline rank ``stage`` in
    megatron-core 0.16.1's interleaved schedule (pipeline_parallel/schedules.py
    ``get_pp_rank_microbatches``): ``2 (PP - stage - 1) + (V - 1) N``, at most ``M x V``."""
    pp, chunks = settings.pipeline_parallel, settings.chunks
    microbatches = settings.pipeline_microbatches if microbatches is None else microbatches
    warmup = 2 * (pp - stage - 1) + (chunks - 1) * _group_size(settings)
    return min(warmup, microbatches * chunks)


def interleaved_order(settings: PlanSettings, stage: int) -> list:
    """``[("F" or "B", microbatch, chunk), ...]``: rank ``stage``'s passes in the order
    megatron-core 0.16.1's ``forward_backward_pipelining_with_interleaving`` runs them (no p2p
    overlap, as the trainer runs it): its schedule table (``get_schedule_table``: groups of ``N``
    microbatches through chunk 0, then chunk 1, ...), the warm-up's forwards, then one forward
    and one backward per step (the backward's chunk reversed: ``V - 1 - chunk``), then the
    cool-down's backwards. The steady state is periodic (``N x V`` steps) once the groups are
    whole, so a long step is replayed over fewer whole groups: enough for the warm-up and two
    periods (the planner's figures do not change; a 64-microbatch plan of a 32B model stays fast)."""
    pp, chunks = settings.pipeline_parallel, settings.chunks
    total_microbatches = settings.pipeline_microbatches
    group = _group_size(settings)
    warmup = interleaved_warmup(settings, stage)
    microbatches = total_microbatches
    if total_microbatches % group == 0:
        microbatches = min(total_microbatches, group * (ceil_div(warmup, group * chunks) + 2))
    table = []
    for start in range(0, microbatches, group):
        stop = microbatches if start + group >= microbatches else start + group
        table.extend((mb, chunk) for chunk in range(chunks) for mb in range(start, stop))
    total = len(table)
    warmup = min(warmup, total)
    order = [("F",) + table[k] for k in range(warmup)]
    for k in range(total - warmup):
        order.append(("F",) + table[warmup + k])
        order.append(("B", table[k][0], chunks - 1 - table[k][1]))
    order.extend(("B", table[k][0], chunks - 1 - table[k][1]) for k in range(total - warmup, total))
    return order


def kl_reduction_bytes(tokens: int, local_vocab: int, mode: str, chunk_elements: int = KL_CHUNK_ELEMENTS) -> int:
    """The transient of the KL controller's reduction over one probe microbatch's logits
    (``tokens`` positions of ``local_vocab``; ops/vocab_parallel.py): three tensors of a token
    chunk's logits, fp32 for ``probe`` (the two log-softmaxes, then their product), fp64 for
    ``linear`` (the softmax weights, the difference, a product)."""
    elements = min(tokens, kl_chunk_rows(local_vocab, chunk_elements)) * local_vocab
    return 3 * elements * (FP64 if mode == "linear" else FP32)


def sr_commit_bytes(shapes, block_elements: int = SR_BLOCK_ELEMENTS) -> int:
    """The transient of a bf16-sr commit over sketched weights of local ``shapes`` (rows, cols):
    its largest row block (whole rows of at most ``block_elements``, at least one;
    logra/masters.py ``block_rows``) as fp32 values and three int64 tensors (the element index,
    the random bits, the bit pattern: ops/rounding.py)."""
    block = max((min(rows, max(1, block_elements // cols)) * cols for rows, cols in shapes), default=0)
    return block * (FP32 + 3 * INT64)


def norm_chunk_bytes(elements: int, chunk_elements: int = NORM_CHUNK_ELEMENTS) -> int:
    """The transient of ``ops/norms.py: squared_norm`` over ``elements``: the fp64 copy of a
    chunk, and while the next one is made, the previous one (two chunks at most)."""
    return min(elements, 2 * chunk_elements) * FP64


def probe_layout(settings: PlanSettings) -> tuple:
    """``(rows per forward, forwards per forecast side)`` of the KL controller's probe set on one
    DP replica: ``--kl-probe-sequences`` rows of its batch (rl/grpo.py ``probe_set``), padded
    ``--micro-batch-size`` at a time; packed, bin-packed into parts of the token budget (every
    row :func:`probe_row_tokens` long, so a part is as many whole rows as the budget holds, one
    at least: rl/packing.py ``token_bins`` on equal lengths)."""
    per_replica = max(1, settings.global_batch_size // settings.data_parallel)
    rows = min(settings.kl_probe_sequences, per_replica)
    if settings.packed:
        per_pass = max(1, min(rows, settings.tokens_per_microbatch // probe_row_tokens(settings)))
    else:
        per_pass = max(1, min(settings.micro_batch_size, rows))
    return per_pass, ceil_div(rows, per_pass)


def probe_row_tokens(settings: PlanSettings) -> int:
    """Tokens of one probe row through the model: padded, a whole training row (``seq_length +
    1``, inputs and the last label, as ``ProbeSet`` takes the batch's rows); packed, the
    ``seq_length`` tokens a packed training microbatch holds per row (the trainer's probe rows
    are rows of its training batch: the default budget then holds ``--micro-batch-size`` of
    them, as the trainer's does)."""
    return settings.seq_length if settings.packed else settings.seq_length + 1


def peak_step_bytes(settings: PlanSettings, stage: int, platform: str = "cuda") -> int:
    """The predicted peak of tensor allocations during one step beyond what was live before it."""
    return activation_bytes(settings, stage, platform)["peak_step_bytes"]


def _check_recompute(settings: PlanSettings) -> None:
    """Megatron's rules for the recompute flags (training/config.py: RecomputeConfig)."""
    from logra_megatron.training.config import RecomputeConfig

    granularity = None if settings.recompute_granularity == "none" else settings.recompute_granularity
    config = RecomputeConfig(granularity, settings.recompute_method, settings.recompute_num_layers)
    config.check_layers(settings.model.layers // settings.pipeline_parallel // settings.chunks)


def global_buffer_bytes(settings: PlanSettings, stage: int = 0) -> int:
    """Megatron's global memory buffer (``get_global_memory_buffer().get_tensor(..., "mpu")``, one
    tensor per dtype, grown to the largest request): allocated by the first step and kept, so it
    is in no step's peak but in the memory a GPU holds. Two users: the unfused attention scores'
    ``baddbmm`` (``b x n x s x s``; SDPA reads no such buffer) and, under sequence parallelism,
    the all-gathered input of Megatron's own column-parallel linears (``T x h``: every linear of
    the dense model, the output layer of LoGRA's, on its last stage; LoGRA's sketching linears
    gather into tensors of their own, and its sketched embeddings do not run under SP)."""
    model = settings.model
    elements = 0
    if resolve_attention_backend(settings.attention_backend) != "sdpa":
        heads = model.heads // settings.tensor_parallel
        elements = settings.micro_batch_size * heads * settings.seq_length ** 2
    if settings.sequence_parallel:
        if settings.optimizer != "logra" or stage == settings.pipeline_parallel - 1:
            # the largest gather of a step: a training microbatch or a probe pass (T_probe x h)
            # (the probe's sequence taken up to a multiple of TP, as _Step._probe_pass does)
            rows, _ = probe_layout(settings)
            tp, length = settings.tensor_parallel, probe_row_tokens(settings)
            whole = (lambda tokens: round_up(tokens, tp))
            probe = whole(rows * length) if settings.packed else rows * whole(length)
            tokens = max(settings.tokens_per_microbatch, probe if settings.kl_control != "off" else 0)
            elements = max(elements, tokens * model.hidden)
    return elements * settings.weight_bytes_per_element

