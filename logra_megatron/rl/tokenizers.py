"""The run's tokenizer: the one named by ``--tokenizer-type/--tokenizer-model``, else the one a
converted Hugging Face checkpoint carries, else the one the checkpoint's Megatron-LM args name
(a checkpoint Megatron-LM wrote, or ours after a start from one), else the embedded
character-level task tokenizer."""

import os
from typing import Optional, Tuple

from logra_megatron.checkpoint_args import read_checkpoint_args
from logra_megatron.errors import UserError
from logra_megatron.rl.checkpointing import TOKENIZER_DIR
from logra_megatron.rl.tasks import tokenizer_corpus
from logra_megatron.tokenizer import HUGGINGFACE_TYPES, SENTENCEPIECE_TYPES, Tokenizer, build_tokenizer, \
    default_task_tokenizer

CACHE_ENV = "LOGRA_CACHE"
"""Where the embedded tokenizer is cached (default ``~/.cache/logra_megatron``)."""


def run_tokenizer_files(model_source, load: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """``(tokenizer type, model path)`` of the run's tokenizer, ``(None, None)`` for the
    embedded one. ``model_source``: a :class:`~logra_megatron.rl.config.ModelSourceConfig`."""
    if model_source.tokenizer_model:
        return model_source.tokenizer_type, os.path.abspath(model_source.tokenizer_model)
    if load and os.path.isfile(os.path.join(load, TOKENIZER_DIR, "tokenizer.json")):
        return "HuggingFaceTokenizer", os.path.abspath(os.path.join(load, TOKENIZER_DIR))
    args = read_checkpoint_args(load) if load else None
    kind, path = getattr(args, "tokenizer_type", None), getattr(args, "tokenizer_model", None)
    if kind is None:
        return None, None
    if kind not in SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES or not path or not os.path.exists(path):
        why = "is not a type the trainer reads" if kind not in SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES else \
            f"its model {path!r} is not on this machine"
        raise UserError(f"--load: the checkpoint's tokenizer (--tokenizer-type {kind} in its args) {why}; pass "
                        "--tokenizer-type and --tokenizer-model")
    return kind, path


def build_run_tokenizer(model_source, load: Optional[str]) -> Tokenizer:
    """``model_source``: a :class:`~logra_megatron.rl.config.ModelSourceConfig`."""
    kind, path = run_tokenizer_files(model_source, load)
    if path is not None:
        return build_tokenizer(kind, path)
    cache = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "logra_megatron"))
    return default_task_tokenizer(cache, tokenizer_corpus())
