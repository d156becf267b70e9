"""Trainer checkpoints: model, optimizer (LoGRA state and projections included) and trainer
state (step = data position, warm-up done, accuracies so far) in one dist checkpoint, so a
resumed run continues exactly (prompts and sampling seeds are functions of the step)."""

import json
import os

import torch.distributed as dist

from logra_megatron.checkpoint import load_checkpoint, save_checkpoint

TRAINER_STATE_FILE = "trainer_state.json"


def _optimizer_sharded(model, optimizer, is_loading=False):
    return optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=is_loading)


def save_training_state(directory, model, optimizer, model_config, state: dict) -> None:
    save_checkpoint(directory, model, model_config,
                    extra_sharded={"optimizer": _optimizer_sharded(model, optimizer)})
    if dist.get_rank() == 0:
        with open(os.path.join(directory, TRAINER_STATE_FILE), "w") as handle:
            json.dump(state, handle)
    dist.barrier()


def load_training_state(directory, model, optimizer) -> dict:
    """Resume a trainer checkpoint; a checkpoint without trainer state (e.g. one written by
    tools/convert_hf_to_mcore.py) only provides the starting weights."""
    path = os.path.join(directory, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        load_checkpoint(directory, model)
        optimizer.reload_model_params()  # the masters were copied from the fresh weights
        return {"step": 0, "warmup_done": False, "summary": {}}
    loaded = load_checkpoint(directory, model,
                             extra_sharded={"optimizer": _optimizer_sharded(model, optimizer, True)})
    optimizer.load_state_dict(loaded["optimizer"])
    with open(path) as handle:
        return json.load(handle)
