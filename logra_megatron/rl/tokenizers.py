"""The run's tokenizer: the one named by ``--tokenizer-type/--tokenizer-model``, else the one a
converted Hugging Face checkpoint carries, else the embedded character-level task tokenizer."""

import os
from typing import Optional

from logra_megatron.rl.tasks import tokenizer_corpus
from logra_megatron.tokenizer import Tokenizer, build_tokenizer, default_task_tokenizer

CACHE_ENV = "LOGRA_CACHE"
"""Where the embedded tokenizer is cached (default ``~/.cache/logra_megatron``)."""


def build_run_tokenizer(model_source, load: Optional[str]) -> Tokenizer:
    """``model_source``: a :class:`~logra_megatron.rl.config.ModelSourceConfig`."""
    if model_source.tokenizer_model:
        return build_tokenizer(model_source.tokenizer_type, model_source.tokenizer_model)
    if load and os.path.isfile(os.path.join(load, "tokenizer", "tokenizer.json")):
        return build_tokenizer("HuggingFaceTokenizer", os.path.join(load, "tokenizer"))
    cache = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "logra_megatron"))
    return default_task_tokenizer(cache, tokenizer_corpus())
