"""Megatron-LM's ``args`` in a checkpoint: the model a Megatron-LM checkpoint holds, and the same
record in ours.

Megatron-LM pickles its whole argument namespace into every checkpoint's common state
(``common.pt`` of a ``torch_dist`` directory, beside ``iteration`` and ``checkpoint_version``);
its ``--use-checkpoint-args`` rebuilds the model from it. We read the architecture from those
args when a checkpoint has no ``model_config.json`` (one written by Megatron-LM), and write them
into ours, so Megatron-LM's loader and tools find what they look for.

Our model family (``models/config.py``) is the Llama / Qwen2 / Mistral transformer; args that
describe anything else (LayerNorm, a GELU MLP, learned positions, mixture of experts, ...) are
refused with one line naming the arg.
"""

import argparse
import copy
import os
import pickle
from typing import Dict, Optional, Tuple

from logra_megatron.errors import UserError
from logra_megatron.models import ModelConfig

COMMON_STATE_FILE = "common.pt"
"""Where dist_checkpointing keeps the non-tensor state of a torch_dist checkpoint."""
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's ``checkpoint_version`` for checkpoints that record TP and PP in their args."""
VOCAB_MULTIPLE = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by`` (ModelConfig.padded_vocab's too)."""

# (arg, the value our family needs, what the value means) for every arg that must be at one value.
_FIXED = (
    ("normalization", "RMSNorm", "the normalization"),
    ("swiglu", True, "a SwiGLU MLP (--swiglu)"),
    ("add_bias_linear", False, "linear layers without bias (--disable-bias-linear)"),
    ("position_embedding_type", "rope", "rotary positions"),
    ("rotary_percent", 1.0, "rotary embedding over the whole head"),
    ("rotary_interleaved", False, "non-interleaved rotary embedding"),
    ("apply_layernorm_1p", False, "plain RMSNorm weights"),
    ("qk_layernorm", False, "no query/key norm"),
    ("num_experts", None, "a dense MLP (no mixture of experts)"),
    ("multi_latent_attention", False, "grouped-query attention (no multi-latent attention)"),
    ("use_rope_scaling", False, "rotary embedding without scaling"),
)


def read_checkpoint_args(directory: str) -> Optional[argparse.Namespace]:
    """The ``args`` namespace of a torch_dist checkpoint's common state, or None when there is
    no common state or no args in it."""
    if not os.path.isfile(os.path.join(directory, COMMON_STATE_FILE)):
        return None
    try:
        state = read_common_state(directory)
    except Exception as error:  # a damaged or foreign file: pickle, zip and torch errors alike
        raise UserError(f"--load: cannot read {os.path.join(directory, COMMON_STATE_FILE)} "
                        f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


_COMMON_STATES: Dict[str, Tuple[tuple, dict]] = {}
"""The last common state read from each file, with the file's identity when it was read (see
:func:`read_common_state`)."""


def read_common_state(directory: str) -> dict:
    """A torch_dist checkpoint's common state (``common.pt``), read from disk once per file per
    process: a start from ``--load`` asks for it several times (is it a checkpoint, its
    architecture, its tokenizer, then dist_checkpointing's load). Read again when the file changed
    (another inode, size or modification time: a new save in its place). Each caller gets its own
    copy: dist_checkpointing merges the loaded tensors into the dict it is given."""
    path = os.path.abspath(os.path.join(directory, COMMON_STATE_FILE))
    stat = os.stat(path)
    identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    kept = _COMMON_STATES.get(path)
    if kept is None or kept[0] != identity:
        kept = _COMMON_STATES[path] = (identity, _load_common_state(path))
    return copy.deepcopy(kept[1])


def _load_common_state(path: str) -> dict:
    import torch  # not at the top: the config schema imports this module before torch is needed

    # Megatron-LM pickles its whole namespace (enums and dtypes of megatron.core and torch, at
    # times classes of megatron.training, which is not installed here): only a full unpickler
    # reads it, as Megatron-LM's own loader does; --load names a checkpoint the user trusts.
    # Classes that do not import here become inert placeholders.
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_lenient_pickle)


def common_state_strategy():
    """A dist_checkpointing common-state loader that reads as :func:`read_common_state` does
    (Megatron's own reads with ``weights_only``, which refuses Megatron-LM's args)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonStateReader(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_common_state(str(checkpoint_dir))

    return CommonStateReader()


def model_config_from_args(args: argparse.Namespace, where: str) -> ModelConfig:
    """The architecture Megatron-LM's ``args`` describe, as our :class:`ModelConfig`; one
    :class:`UserError` naming the arg when they describe a model outside our family."""
    for name, needed, meaning in _FIXED:
        value = getattr(args, name, needed)
        if name == "position_embedding_type" and value != "rope" and getattr(args, "use_rotary_position_embeddings",
                                                                             False):
            value = "rope"  # Megatron-LM's older flag for the same thing
        if value != needed and not (needed is None and not value):
            raise UserError(f"--load: {where} is a Megatron-LM model with {name}={value!r}; the trainer's model "
                            f"family needs {meaning} ({name}={needed!r})")
    missing = [name for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                 "padded_vocab_size") if not isinstance(getattr(args, name, None), int)]
    if missing:
        raise UserError(f"--load: {where}: Megatron-LM's args miss {', '.join(missing)}; pass a checkpoint written "
                        "by Megatron-LM's training loop")
    heads = args.num_attention_heads
    kv_heads = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    kv_channels = getattr(args, "kv_channels", None)
    qkv_bias = bool(getattr(args, "add_qkv_bias", False))
    max_seq = getattr(args, "max_position_embeddings", None) or getattr(args, "seq_length", None)
    try:
        return ModelConfig(
            hidden=args.hidden_size, layers=args.num_layers, heads=heads, kv_heads=kv_heads,
            ffn_hidden=args.ffn_hidden_size,
            # Megatron-LM sizes the embedding to padded_vocab_size (its tokenizer's vocabulary
            # rounded up): the rows beyond the tokenizer's are there and trained as zeros; the
            # trainer's losses and sampling see the tokenizer's ids only.
            vocab=args.padded_vocab_size,
            max_seq=max_seq or ModelConfig.max_seq,
            rope_theta=float(getattr(args, "rotary_base", None) or ModelConfig.rope_theta),
            norm_eps=float(getattr(args, "norm_epsilon", None) or ModelConfig.norm_eps),
            tie_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
            qkv_bias=qkv_bias,
            head_dim=kv_channels if kv_channels and kv_channels * heads != args.hidden_size else None,
            family="qwen2" if qkv_bias else "llama")
    except (TypeError, ValueError, UserError) as error:
        raise UserError(f"--load: {where}: Megatron-LM's args describe no valid model ({error})") from None


def megatron_lm_args(model: ModelConfig, tensor_parallel: int, pipeline_parallel: int, *,
                     virtual_pipeline: Optional[int] = None, iteration: int = 0, bf16: bool = False,
                     tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                     seq_length: Optional[int] = None) -> argparse.Namespace:
    """Megatron-LM's ``args`` for ``model`` at a layout: the names its
    ``load_args_from_checkpoint`` and converters read (and :func:`model_config_from_args` reads
    back to ``model``)."""
    import torch  # (see read_checkpoint_args)

    return argparse.Namespace(
        num_layers=model.layers, hidden_size=model.hidden, ffn_hidden_size=model.ffn_hidden,
        num_attention_heads=model.heads, group_query_attention=model.kv_heads != model.heads,
        num_query_groups=model.kv_heads, kv_channels=model.kv_channels,
        max_position_embeddings=model.max_seq, seq_length=seq_length or model.max_seq,
        position_embedding_type="rope", use_rotary_position_embeddings=True, add_position_embedding=False,
        rotary_base=int(model.rope_theta), rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", norm_epsilon=model.norm_eps, apply_layernorm_1p=False,
        swiglu=True, add_bias_linear=False, add_qkv_bias=model.qkv_bias, qk_layernorm=False,
        untie_embeddings_and_output_weights=not model.tie_embeddings,
        padded_vocab_size=model.padded_vocab(tensor_parallel, VOCAB_MULTIPLE),
        make_vocab_size_divisible_by=VOCAB_MULTIPLE,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
        ckpt_format="torch_dist", transformer_impl="local", iteration=iteration,
        consumed_train_samples=0, consumed_valid_samples=0)


class _Placeholder:
    """Stands for a pickled class that does not import here (e.g. from megatron.training)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": module})


class _lenient_pickle:  # noqa: N801 - torch.load's pickle_module: a module-like namespace
    Unpickler = _LenientUnpickler
    load = staticmethod(pickle.load)
