"""A Megatron-LM checkpoint's common state (``common.pt``) is read from disk once per process
(checkpoint_args.py: read_common_state), though a start from ``--load`` asks for it several
times (is it a checkpoint, its architecture, its tokenizer, dist_checkpointing's load); read again
when the file changes, and each caller gets a copy of its own."""

import json

import pytest
import torch
from local_tokenizers import hf_tokenizer_folder

from logra_megatron import checkpoint_args
from logra_megatron.checkpoint_args import COMMON_STATE_FILE, megatron_lm_args, read_common_state
from logra_megatron.checkpoint_layout import TRACKER_FILE
from logra_megatron.models import PRESETS


@pytest.fixture
def disk_reads(monkeypatch):
    """How many times ``torch.load`` read a file (the common state's only reader)."""
    reads = []
    original = torch.load

    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    return reads


def megatron_lm_save(root, tokenizer, iteration=3):
    """A Megatron-LM save root without tensors: one iteration's common state (args naming
    ``tokenizer``), metadata.json, ``.metadata``, the tracker."""
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    args = megatron_lm_args(PRESETS["tiny"], 1, 1, iteration=iteration, tokenizer_type="HuggingFaceTokenizer",
                            tokenizer_model=str(tokenizer))
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0}, directory / COMMON_STATE_FILE)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (directory / ".metadata").write_bytes(b"")
    (root / TRACKER_FILE).write_text(str(iteration))
    return directory


def test_resolving_a_megatron_lm_load_reads_its_common_state_once(tmp_path, disk_reads):
    from logra_megatron.config import parse_train_args

    directory = megatron_lm_save(tmp_path / "run", hf_tokenizer_folder(tmp_path / "tokenizer"))
    config = parse_train_args(["--load", str(tmp_path / "run"), "--max-operand", "4", "--eval-prompts", "4",
                               "--prompts-per-step", "2", "--group-size", "2", "--micro-batch-size", "4"],
                              world_size=1)
    # The architecture and the tokenizer came from the args (not the tiny preset's embedded ones).
    assert config.load_dir == str(directory)
    assert type(config.inputs.tokenizer).__name__ == "HuggingFaceTokenizer"
    common = [path for path in disk_reads if path.endswith(COMMON_STATE_FILE)]
    assert len(common) == 1, disk_reads
    # The trainer's load (dist_checkpointing's common state, through this module) reads nothing more.
    state = checkpoint_args.common_state_strategy().load_common(directory)
    assert state["iteration"] == 3 and len(disk_reads) == len(common) == 1, disk_reads


def test_each_caller_gets_its_own_copy_and_a_changed_file_is_read_again(tmp_path, disk_reads):
    directory = megatron_lm_save(tmp_path / "run", tmp_path / "tokenizer")
    first = read_common_state(str(directory))
    first["model"] = "merged by dist_checkpointing"  # (its load merges tensors into the dict it gets)
    first["args"].num_layers = -1
    second = read_common_state(str(directory))
    assert "model" not in second and second["args"].num_layers == PRESETS["tiny"].layers
    assert len(disk_reads) == 1
    # A new save in its place is read anew (here larger: the kernel's file times are coarse, a few
    # milliseconds, so two writes this close may share one).
    torch.save({"args": second["args"], "iteration": 10, "checkpoint_version": 3.0, "saved_again": True},
               directory / COMMON_STATE_FILE)
    assert read_common_state(str(directory))["iteration"] == 10 and len(disk_reads) == 2
