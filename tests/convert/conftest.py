"""Fixtures for the conversion tests: the tiny HF models, saved once per session."""

import os

import pytest
from convert_tiny import TINY, build_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder of a saved tiny HF model (fp32 safetensors, config.json)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    dirs = {}
    for index, (name, (family, tie, extra)) in enumerate(TINY.items()):
        model = build_tiny(family, tie, extra, seed=index)
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs
