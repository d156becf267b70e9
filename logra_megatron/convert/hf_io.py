"""Reading and writing Hugging Face model folders, offline and without transformers.

A conversion only needs ``config.json``, the weight files and the tokenizer files, so these
helpers read them directly: safetensors lazily (a rank reads just the tensors of its pipeline
stage), ``pytorch_model.bin`` memory-mapped. Every problem with the folder is a
:class:`UserError` with one line that names the file.
"""

import json
import os
import shutil
from collections.abc import Mapping

import torch

from logra_megatron.errors import UserError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Weight layouts save_pretrained writes, in the order we prefer them.
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors",
                "pytorch_model.bin.index.json", "pytorch_model.bin")
# Files a tokenizer may consist of (any family); copied when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
TOKENIZER_DIR = "tokenizer"
# Inside a Megatron checkpoint: the source model's HF config files, so the reverse conversion
# restores fields our ModelConfig does not carry (token ids, dtype).
HF_SOURCE_DIR = "hf_source"
SHARD_BYTES = 5 * 1024 ** 3


def check_hf_dir(directory: str) -> str:
    """Raise a :class:`UserError` unless ``directory`` has a config and weights; returns the
    weight file (or index) that will be read."""
    if not os.path.isdir(directory):
        raise UserError(f"Hugging Face model directory not found: {directory}")
    if not os.path.isfile(os.path.join(directory, CONFIG_FILE)):
        raise UserError(f"{directory} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            return name
    raise UserError(f"{directory} has no weights: expected one of {', '.join(WEIGHT_FILES)}")


def read_hf_config(directory: str) -> dict:
    """The parsed ``config.json`` of an HF folder (a :class:`UserError` if it is unreadable)."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise UserError(f"{directory} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {error}") from None


class HFWeights(Mapping):
    """The tensors of an HF folder by name, read from disk on access (nothing up front)."""

    def __init__(self, directory: str):
        self.directory = directory
        weight_file = check_hf_dir(directory)
        self._file_of = {}  # tensor name -> file path
        self._bin_cache = {}
        if weight_file.endswith(".index.json"):
            try:
                with open(os.path.join(directory, weight_file)) as handle:
                    weight_map = json.load(handle)["weight_map"]
            except (OSError, ValueError, KeyError) as error:
                raise UserError(f"cannot read {os.path.join(directory, weight_file)}: {error}") from None
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(directory, file)):
                    raise UserError(f"{weight_file} lists {file}, which is missing from {directory}")
            files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        else:
            path = os.path.join(directory, weight_file)
            files = {name: path for name in self._names_in(path)}
        self._file_of = files

    def _names_in(self, path: str) -> list:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as handle:
                    return list(handle.keys())
            except Exception as error:  # a truncated or foreign file
                raise UserError(f"cannot read {path}: {error}") from None
        return list(self._load_bin(path))

    def _load_bin(self, path: str) -> dict:
        if path not in self._bin_cache:
            try:
                self._bin_cache[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:
                raise UserError(f"cannot read {path}: {error}") from None
        return self._bin_cache[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(name)
        return self._load_bin(path)[name]

    def __contains__(self, name):
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self):
        return len(self._file_of)


def copy_tokenizer(src: str, dst: str) -> list:
    """Copy the tokenizer files found in ``src`` into ``dst`` (created only if there are any);
    returns the names copied."""
    found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    if found:
        os.makedirs(dst, exist_ok=True)
        for name in found:
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return found


def save_hf_source(hf_dir: str, checkpoint_dir: str) -> None:
    """Keep the source model's ``config.json`` (and generation config) in the checkpoint."""
    target = os.path.join(checkpoint_dir, HF_SOURCE_DIR)
    os.makedirs(target, exist_ok=True)
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(target, name))


def load_hf_source(checkpoint_dir: str):
    """The source model's HF config saved by :func:`save_hf_source`, or ``None``."""
    path = os.path.join(checkpoint_dir, HF_SOURCE_DIR, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def check_output_dir(directory: str, flag: str) -> None:
    """A :class:`UserError` if ``directory`` exists and is not empty (nothing is overwritten),
    or is a file."""
    if os.path.isfile(directory):
        raise UserError(f"{flag} {directory} is a file; give a directory")
    if os.path.isdir(directory) and os.listdir(directory):
        raise UserError(f"{flag} {directory} is not empty; choose a new directory")


def _shards(tensors: dict, max_bytes: int) -> list:
    """Split ``tensors`` into groups of at most ``max_bytes`` (a larger tensor stays alone)."""
    groups, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current:
        groups.append(current)
    return groups


def write_hf_weights(tensors: dict, directory: str, max_shard_bytes: int = SHARD_BYTES) -> list:
    """Write ``tensors`` as ``save_pretrained`` does: one ``model.safetensors``, or numbered
    shards plus ``model.safetensors.index.json`` above ``max_shard_bytes``. Returns the files."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    groups = _shards(tensors, max_shard_bytes)
    if len(groups) == 1:
        save_file(groups[0], os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for index, group in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, os.path.join(directory, file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update({name: file for name in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
    return files + ["model.safetensors.index.json"]
