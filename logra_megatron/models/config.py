"""The decoder-only model family we train: Llama, Qwen2 and Mistral style transformers.

All three are the same network up to a few switches (RMSNorm, SwiGLU MLP, rotary positions,
grouped-query attention; Qwen2 adds a QKV bias; small models tie the input embedding to the
output layer), so one dataclass describes them and named presets give published dimensions.
"""

from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.registry import Registry


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and switches of one decoder-only transformer. Validated on construction."""

    hidden: int
    """Width of the residual stream."""
    layers: int
    """Number of transformer layers."""
    heads: int
    """Query attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    ffn_hidden: int
    """Inner width of the SwiGLU MLP (each of the gate and up projections)."""
    vocab: int
    """Vocabulary size (Megatron pads it for tensor parallelism; see ``padded_vocab``)."""
    max_seq: int = 2048
    """Longest sequence the rotary embedding is built for."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    qkv_bias: bool = False
    """Bias on the query/key/value projection (Qwen2 family)."""
    head_dim: Optional[int] = None
    """Per-head width; ``None`` means hidden / heads."""
    family: str = "llama"
    """Which Hugging Face architecture this mirrors: llama, qwen2 or mistral."""

    def __post_init__(self):
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            if getattr(self, field) < 1:
                raise UserError(f"model {field} must be positive, got {getattr(self, field)}")
        if self.heads % self.kv_heads != 0:
            raise UserError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.hidden % self.heads != 0:
            raise UserError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.family not in ("llama", "qwen2", "mistral"):
            raise UserError(f"unknown model family {self.family!r}; use llama, qwen2 or mistral")

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def padded_vocab(self, tensor_parallel: int = 1, multiple: int = 128) -> int:
        """Vocab rounded up so every TP rank holds an equal slice (Megatron's convention)."""
        step = multiple * tensor_parallel
        return ((self.vocab + step - 1) // step) * step

    def num_parameters(self) -> int:
        """Parameter count (unpadded vocab)."""
        q = self.heads * self.kv_channels
        kv = 2 * self.kv_heads * self.kv_channels
        attention = self.hidden * (q + kv) + q * self.hidden + (q + kv if self.qkv_bias else 0)
        mlp = 3 * self.hidden * self.ffn_hidden
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**values)

    def with_changes(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


PRESETS = {
    # Small enough for CPU tests and the demo: 4 layers so PP=2 and PP=4 split it, 4 heads and
    # 2 kv heads so TP=2 splits both.
    "tiny": ModelConfig(hidden=64, layers=4, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                        max_seq=256, family="llama"),
    # HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2-135m": ModelConfig(hidden=576, layers=30, heads=9, kv_heads=3, ffn_hidden=1536,
                                vocab=49152, max_seq=8192, rope_theta=100000.0, norm_eps=1e-5,
                                tie_embeddings=True, family="llama"),
    # Qwen/Qwen2.5-0.5B.
    "qwen2.5-0.5b": ModelConfig(hidden=896, layers=24, heads=14, kv_heads=2, ffn_hidden=4864,
                                vocab=151936, max_seq=32768, rope_theta=1000000.0, norm_eps=1e-6,
                                tie_embeddings=True, qkv_bias=True, family="qwen2"),
    # Qwen/Qwen2.5-1.5B.
    "qwen2.5-1.5b": ModelConfig(hidden=1536, layers=28, heads=12, kv_heads=2, ffn_hidden=8960,
                                vocab=151936, max_seq=32768, rope_theta=1000000.0, norm_eps=1e-6,
                                tie_embeddings=True, qkv_bias=True, family="qwen2"),
    # Qwen/Qwen2.5-7B.
    "qwen2.5-7b": ModelConfig(hidden=3584, layers=28, heads=28, kv_heads=4, ffn_hidden=18944,
                              vocab=152064, max_seq=32768, rope_theta=1000000.0, norm_eps=1e-6,
                              qkv_bias=True, family="qwen2"),
    # meta-llama/Meta-Llama-3-8B.
    "llama3-8b": ModelConfig(hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336,
                             vocab=128256, max_seq=8192, rope_theta=500000.0, norm_eps=1e-5,
                             family="llama"),
    # The 27B-class target of the memory planner: Qwen/Qwen2.5-32B (32.8B parameters), the
    # largest published model of our supported families near the paper's 27B.
    "qwen2.5-32b": ModelConfig(hidden=5120, layers=64, heads=40, kv_heads=8, ffn_hidden=27648,
                               vocab=152064, max_seq=32768, rope_theta=1000000.0, norm_eps=1e-5,
                               qkv_bias=True, family="qwen2"),
    # google/gemma-2-27b's published config.json (27.2B parameters): hidden 4608, 46 layers, 32
    # heads of 128 with 16 kv heads, intermediate 36864, vocab 256000, tied embeddings. For memory
    # planning (tools/plan_memory.py): our family cannot express Gemma 2's logit soft-capping
    # (attention 50, final 30), its alternating sliding-window (4096) local attention, GeGLU
    # (gelu-tanh) instead of SwiGLU (the same three matrices), the attention scale
    # 1/sqrt(144), the sqrt(hidden) embedding scale, RMSNorm's (1 + w) and the post-attention and
    # post-FFN norms (2 x 4608 parameters per layer, left out here). Memory does not depend on any
    # of them except those norms (0.4M parameters, negligible). family="llama": the field allows
    # llama, qwen2 or mistral only.
    "gemma-2-27b": ModelConfig(hidden=4608, layers=46, heads=32, kv_heads=16, ffn_hidden=36864,
                               vocab=256000, max_seq=8192, rope_theta=10000.0, norm_eps=1e-6,
                               tie_embeddings=True, head_dim=128, family="llama"),
    # A dense Llama-style model near 27B whose architecture our family expresses exactly:
    # mistralai/Mistral-Small-24B-Base-2501's published config.json (23.6B parameters; no
    # sliding window): hidden 5120, 40 layers, 32 heads of 128 with 8 kv heads, intermediate
    # 32768, vocab 131072, rope theta 1e8, untied.
    "mistral-small-24b": ModelConfig(hidden=5120, layers=40, heads=32, kv_heads=8, ffn_hidden=32768,
                                     vocab=131072, max_seq=32768, rope_theta=100000000.0, norm_eps=1e-5,
                                     head_dim=128, family="mistral"),
}


def _is_core_attention(obj) -> Optional[str]:
    if not isinstance(obj, type):
        return "a core attention is a module class, as Megatron's layer spec takes for core_attention"
    return None


ATTENTION_BACKENDS = Registry("attention backend", "--attention-backend", accepts=_is_core_attention)
"""``--attention-backend`` (Megatron-LM's flag; our values): the core attention in the layer spec.
``sdpa``: torch's ``scaled_dot_product_attention`` (``models/sdpa_attention.py``; flash or
memory-efficient kernels on CUDA, O(s) memory per head); ``unfused``: Megatron's
``DotProductAttention`` (the ``b x heads x s x s`` scores in memory); ``auto``: sdpa. Outside code
comes by ``package.module:Class`` (a ``core_attention`` module for the layer spec); the memory
planner counts it as ``unfused`` (scores in memory), the conservative choice. Declared by path:
reading the flag imports neither torch nor Megatron."""
ATTENTION_BACKENDS.register("auto", "logra_megatron.models.sdpa_attention:SDPAttention",
                            help="sdpa; with Transformer Engine, its own fused attention")
ATTENTION_BACKENDS.register("sdpa", "logra_megatron.models.sdpa_attention:SDPAttention",
                            help="torch's scaled_dot_product_attention: flash or memory-efficient kernels on CUDA")
ATTENTION_BACKENDS.register("unfused", "megatron.core.transformer.dot_product_attention:DotProductAttention",
                            help="Megatron's DotProductAttention, the b x heads x s x s scores in memory")


def resolve_attention_backend(name: str) -> str:
    """``sdpa``, ``unfused`` or an outside ``package.module:Class`` for an ``--attention-backend``
    value (``auto`` is sdpa); an unknown name is one :class:`UserError`."""
    ATTENTION_BACKENDS.check(name)
    return "sdpa" if name == "auto" else name


def get_preset(name: str) -> ModelConfig:
    """The named preset, or a :class:`UserError` that lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
