"""Checkpoints through Megatron's ``dist_checkpointing``: save at one TP/PP, load at another.

A checkpoint directory holds the sharded tensors (torch_dist format) and ``model_config.json``
(our :class:`ModelConfig`), so a loader can build the right model before reading weights, and in
its common state Megatron-LM's ``args`` (``checkpoint_args.py``), so Megatron-LM reads it too. A
directory Megatron-LM wrote (``args``, no ``model_config.json``) loads the same way: its model
is the one its args describe. Optimizer and trainer state are added to the same sharded state
dict by their owners.
"""

import json
import os
import queue

import torch.distributed as dist

from logra_megatron.checkpoint_args import (CHECKPOINT_VERSION, common_state_strategy, model_config_from_args,
                                             read_checkpoint_args)
from logra_megatron.errors import UserError
from logra_megatron.models import ModelConfig
from logra_megatron.platform.parent_death import forks_die_with_this_process

MODEL_CONFIG_FILE = "model_config.json"


def save_model_config(model_config: ModelConfig, directory: str) -> None:
    """Write ``model_config.json`` (rank 0 only)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, MODEL_CONFIG_FILE), "w") as handle:
            json.dump(model_config.to_dict(), handle, indent=2)


def load_model_config(directory: str) -> ModelConfig:
    """A checkpoint's architecture: its ``model_config.json``, else (a checkpoint Megatron-LM
    wrote) the one its ``args`` describe; a clear error if the checkpoint is missing."""
    check_checkpoint_dir(directory)
    path = os.path.join(directory, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        return model_config_from_args(read_checkpoint_args(directory), directory)
    with open(path) as handle:
        return ModelConfig.from_dict(json.load(handle))


def check_checkpoint_dir(directory: str) -> None:
    """Raise a :class:`UserError` unless ``directory`` is one of our checkpoints or Megatron-LM's."""
    if not os.path.isdir(directory):
        raise UserError(f"checkpoint directory not found: {directory}")
    if not is_checkpoint_dir(directory):
        raise UserError(f"{directory} is not a checkpoint: no {MODEL_CONFIG_FILE} (ours) and no Megatron-LM args "
                        "in a torch_dist common state")


def is_checkpoint_dir(directory: str) -> bool:
    """``directory`` holds one checkpoint: ours (``model_config.json``) or Megatron-LM's (its
    ``args`` in the common state)."""
    return (os.path.isfile(os.path.join(directory, MODEL_CONFIG_FILE))
            or read_checkpoint_args(directory) is not None)


def save_checkpoint(directory: str, model, model_config: ModelConfig, extra_sharded: dict = None,
                    megatron_args=None) -> None:
    """Save ``model`` (one rank's shard, collective over all ranks) and its config.

    ``extra_sharded`` is merged into the sharded state dict (optimizer, trainer state);
    ``megatron_args`` (``checkpoint_args.megatron_lm_args``) goes into the common state as
    Megatron-LM keeps it, with its ``iteration`` and the checkpoint version.
    """
    from megatron.core import dist_checkpointing  # not at the top: the config schema reads model_config.json

    os.makedirs(directory, exist_ok=True)
    _use_a_process_free_results_queue()
    if dist.is_initialized():
        dist.barrier()
    state = {"model": model.sharded_state_dict()}
    if extra_sharded:
        state.update(extra_sharded)
    if megatron_args is not None:
        state.update(args=megatron_args, iteration=megatron_args.iteration, checkpoint_version=CHECKPOINT_VERSION)
    # Megatron forks a writer per file bucket; killed mid-save, the trainer takes them along
    # (platform/parent_death.py says why they would otherwise outlive it).
    with forks_die_with_this_process():
        dist_checkpointing.save(state, directory)
    save_model_config(model_config, directory)
    if dist.is_initialized():
        dist.barrier()


def _use_a_process_free_results_queue() -> None:
    """Megatron's checkpoint file writer (dist_checkpointing/strategies/filesystem_async.py)
    collects write results in a queue served by a ``multiprocessing.Manager``: a spawned server
    process that outlives a trainer killed with SIGKILL (measured: orphaned, still holding the
    trainer's stdout). Saving synchronously, the queue is only used inside this process (put,
    then ``get_nowait``), so an in-process ``queue.Queue`` serves the same purpose. Megatron
    creates the queue once per process and caches it in a module global: set it first."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def load_checkpoint(directory: str, model, extra_sharded: dict = None) -> dict:
    """Load a checkpoint into ``model`` at the current layout (any TP/PP); returns the loaded
    state dict so that owners of ``extra_sharded`` entries can restore theirs."""
    from megatron.core import dist_checkpointing  # (see save_checkpoint)

    check_checkpoint_dir(directory)
    request = {"model": model.sharded_state_dict()}
    if extra_sharded:
        request.update(extra_sharded)
    loaded = dist_checkpointing.load(request, directory, common_strategy=common_state_strategy())
    model.load_state_dict(loaded["model"], strict=True)
    return loaded
