"""Trainer checkpoints: what one iteration's directory holds, and how a run resumes from it.

Each save writes ``<save>/iter_NNNNNNN`` (the layout, the atomic rename and the manifest check
are in logra_megatron/checkpoint_layout.py) holding, in one ``dist_checkpointing`` save, the model
and the optimizer (LoGRA sketches, moments, projections, masters and counters included), and in
``trainer_state.json`` the trainer's state: the next step (the data position and every seed are
functions of it), warm-up done, accuracies so far, the KL controller's counters, the skip
counters, and the settings a resumed optimizer must share (``checkpoint``). The tokenizer a run
started from (a converted checkpoint's ``tokenizer/``) is copied along, so a resume needs no flag.

Loading checks those settings before reading any tensor and turns every unreadable file into one
``error:`` line naming it; ``--no-load-optim`` takes the weights (and the trainer state) only, with
fresh optimizer state: how a dense checkpoint's weights start a LoGRA run.

A run of several ranks checks at its start, before any training, that ``--save`` is one directory
every rank sees (:func:`check_shared_checkpoints`): every rank writes its shards of an iteration
into it and rank 0 publishes the iteration, so on several nodes it must be on a shared filesystem
(docs/MULTI_NODE.md).
"""

import json
import os
import shutil
import socket
import sys
import time
import uuid
from typing import List, Optional

import torch.distributed as dist

from logra_megatron.checkpoint import load_checkpoint, save_checkpoint
from logra_megatron.checkpoint_layout import atomic_write_text, partial_dir, publish, remove_partials
from logra_megatron.errors import UserError, one_line
from logra_megatron.faults import kill_point
from logra_megatron.optim.megatron_internals import DISTRIBUTED_CHECKPOINT_METADATA, loading_distributed_adam_state

TRAINER_STATE_FILE = "trainer_state.json"
TOKENIZER_DIR = "tokenizer"
COMPATIBILITY_FLAGS = {"optimizer": "--optimizer", "logra_rank": "--logra-rank", "logra_max_rank": "--logra-max-rank",
                       "logra_master": "--logra-master", "logra_embeddings": "--logra-embeddings",
                       "logra_update": "--logra-update"}
"""The optimizer settings whose state a resumed run reads; they must match the checkpoint's."""


def optimizer_compatibility(config) -> dict:
    """The settings of ``config`` (a TrainConfig) that shape the optimizer's saved state."""
    settings = {"optimizer": config.optimizer.kind}
    if config.optimizer.sketched:
        settings.update(logra_rank=config.logra.rank, logra_master=config.logra.master,
                        logra_embeddings=config.logra.embeddings, logra_update=config.logra.update)
        if isinstance(config.logra.rank, float):  # the cap shapes the state of a fractional rank only
            settings["logra_max_rank"] = config.logra.max_rank
    return settings


class ModelChunks:
    """The model chunks of a virtual pipeline as one model for ``save_checkpoint`` and
    ``load_checkpoint``: one ``model<i>`` entry per chunk, as Megatron-LM's checkpointing names
    them. The tensors inside are keyed by their global layer numbers (Megatron offsets each
    chunk's layers), so a checkpoint saved with chunks loads at any pipeline layout, with or
    without them, and the other way round."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def sharded_state_dict(self) -> dict:
        return {f"model{index}": chunk.sharded_state_dict() for index, chunk in enumerate(self.chunks)}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        for index, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state[f"model{index}"], strict=strict)


def _one_model(model):
    """``model``, or the list of a virtual pipeline's chunks as one (:class:`ModelChunks`)."""
    return ModelChunks(model) if isinstance(model, (list, tuple)) else model


def _optimizer_sharded(model, optimizer, is_loading=False):
    # Megatron's distributed optimizer saved per parameter: loadable at any TP/PP/DP.
    return optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=is_loading,
                                        metadata=DISTRIBUTED_CHECKPOINT_METADATA)


def save_training_state(root: str, model, optimizer, model_config, state: dict, compatibility: dict,
                        keep: int = 0, tokenizer_dir: Optional[str] = None, megatron_args=None) -> None:
    """Save iteration ``state["step"]`` under ``root`` (collective over all ranks);
    ``megatron_args``: Megatron-LM's args for the common state (``checkpoint_args.py``). ``model``:
    one model, or a virtual pipeline's list of chunks."""
    model = _one_model(model)
    first = dist.get_rank() == 0
    if first:
        os.makedirs(root, exist_ok=True)
        remove_partials(root)
    dist.barrier()
    directory = partial_dir(root, state["step"])
    kill_point("save:start")
    save_checkpoint(directory, model, model_config, extra_sharded={"optimizer": _optimizer_sharded(model, optimizer)},
                    megatron_args=megatron_args)
    kill_point("save:tensors")
    if first:
        if tokenizer_dir and os.path.isdir(tokenizer_dir):
            shutil.copytree(tokenizer_dir, os.path.join(directory, TOKENIZER_DIR))
        atomic_write_text(os.path.join(directory, TRAINER_STATE_FILE),
                          json.dumps(dict(state, checkpoint=compatibility), indent=1))
        kill_point("save:state")
        publish(root, state["step"], keep)
        kill_point("save:published")
    dist.barrier()


SHARED_CHECK_PREFIX = ".logra-shared-check-"
SHARED_CHECK_GRACE_S = 2.0
"""How long a rank looks for rank 0's marker before it says it does not see it (a network
filesystem may show a new file to other clients a moment late)."""


def check_shared_checkpoints(save: Optional[str], load_dir: Optional[str]) -> None:
    """Before training (collective; nothing to check with one rank): ``save`` must be one directory
    that every rank sees, and every rank must have resolved ``--load`` to the same checkpoint.

    Rank 0 writes a marker file with a fresh name into ``save``; every rank looks for it there.
    A rank that does not see it (another node's local disk, or a relative path resolved against
    another working directory) would write its shards where rank 0 never publishes them, so the
    run stops now, on every rank, with one ``error:`` line (:func:`shared_checkpoint_problem`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or (not save and not load_dir):
        return
    first = dist.get_rank() == 0
    token, failure = uuid.uuid4().hex, None
    marker = None
    if save:
        try:
            os.makedirs(save, exist_ok=True)  # every rank: its mkdir also refreshes a stale view of the path
            if first:
                marker = os.path.join(save, SHARED_CHECK_PREFIX + token)
                atomic_write_text(marker, token)
        except OSError as error:
            failure = f"{type(error).__name__}: {error.strerror or error}"
    shared = [token]
    dist.broadcast_object_list(shared, src=0)  # (after rank 0 wrote the marker)
    token = shared[0]
    seen = None
    if save and failure is None:
        seen = _sees(os.path.join(save, SHARED_CHECK_PREFIX + token), token)
    mine = {"rank": dist.get_rank(), "node": os.environ.get("GROUP_RANK", "?"), "host": socket.gethostname(),
            "save": os.path.abspath(save) if save else None, "sees_marker": seen, "failure": failure,
            "load": _checkpoint_name(load_dir)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if marker is not None:
        try:
            os.remove(marker)
        except OSError:
            pass
    problem = shared_checkpoint_problem(save, everyone)
    if problem:
        error = UserError(problem)
        error.printed = True  # by rank 0 alone (the other nodes' ranks found the same), before any rank
        if first:             # exits: torchrun stops a node's other ranks when the first one ends
            print(f"error: {one_line(problem)}", file=sys.stderr, flush=True)
        dist.barrier()
        raise error


def _sees(path: str, token: str) -> bool:
    deadline = time.monotonic() + SHARED_CHECK_GRACE_S
    while True:
        try:
            with open(path) as handle:
                if handle.read() == token:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _checkpoint_name(load_dir: Optional[str]) -> Optional[str]:
    """What a rank resolved ``--load`` to, comparable across nodes: the iteration's directory name
    (``iter_NNNNNNN``) or, for converted weights, the directory's name."""
    return os.path.basename(os.path.normpath(load_dir)) if load_dir else None


def _ranks_text(reports: List[dict]) -> str:
    ranks = ", ".join(str(report["rank"]) for report in reports)
    nodes = sorted({f"node {report['node']} on host {report['host']}" for report in reports})
    return f"rank{'s' if len(reports) > 1 else ''} {ranks} ({'; '.join(nodes)})"


def shared_checkpoint_problem(save: Optional[str], reports: List[dict]) -> Optional[str]:
    """The one line that stops a run whose ranks do not share its checkpoints (``reports``: every
    rank's findings, rank 0's first), or None."""
    first = reports[0]
    failed = [report for report in reports if report["failure"]]
    if failed:
        return (f"--save {save}: {_ranks_text(failed)} cannot create it or write there "
                f"({failed[0]['failure']}); give a directory every rank can write")
    blind = [report for report in reports if report["sees_marker"] is False]
    if blind:
        where = blind[0]["save"]
        looked = f"; they look in {where}" if where != first["save"] else ""
        return (f"--save {save} is not one directory shared by every rank: {_ranks_text(blind)} "
                f"{'does' if len(blind) == 1 else 'do'} not see the file rank 0 wrote in {first['save']}{looked}. Every rank writes its shards of a checkpoint "
                "there and rank 0 publishes it, so a run on several nodes needs --save on a filesystem all "
                "nodes share, as an absolute path or relative to a working directory that is the same on every "
                "node (docs/MULTI_NODE.md)")
    differ = [report for report in reports if report["load"] != first["load"]]
    if differ:
        ours, theirs = (first["load"] or "nothing (a fresh start)"), (differ[0]["load"] or "nothing (a fresh start)")
        return (f"the ranks resolved --load to different checkpoints: rank 0 loads {ours}, {_ranks_text(differ)} "
                f"{theirs}; every node must see the same checkpoints there (a shared "
                "filesystem, or identical copies at that path) (docs/MULTI_NODE.md)")
    return None


def load_training_state(directory: str, model, optimizer, compatibility: dict, load_optim: bool = True) -> dict:
    """Restore ``directory`` (one iteration, or converted weights) into ``model`` and
    ``optimizer``; returns the trainer state (empty for converted weights). ``model``: one model,
    or a virtual pipeline's list of chunks."""
    model = _one_model(model)
    path = os.path.join(directory, TRAINER_STATE_FILE)
    if not os.path.isfile(path):  # e.g. tools/convert_hf_to_mcore.py: starting weights only
        _load(directory, model)
        optimizer.reload_model_params()  # the masters were copied from the fresh weights
        return {}
    state = read_trainer_state(path)
    saved = state.pop("checkpoint", {})
    if not load_optim:
        _load(directory, model)
        optimizer.reload_model_params()
        # The KL controller's counters and budget schedule size the optimizer's steps: they start
        # fresh with its state (a warmed-up start may be loaded by runs with other budgets).
        state.pop("controller", None)
        return state
    differ = [key for key, value in compatibility.items() if key in saved and saved[key] != value]
    if saved.get("optimizer") != compatibility["optimizer"] and "optimizer" not in differ:
        differ.insert(0, "optimizer")
    if differ:
        theirs = " ".join(f"{COMPATIBILITY_FLAGS[key]} {saved.get(key)}" for key in differ)
        ours = " ".join(f"{COMPATIBILITY_FLAGS[key]} {compatibility.get(key)}" for key in differ)
        raise UserError(f"checkpoint {directory} was written with {theirs}, this run has {ours}: resume with "
                        "the checkpoint's settings, or add --no-load-optim to start from its weights with "
                        "fresh optimizer state")
    try:
        with loading_distributed_adam_state(optimizer):
            loaded = _load(directory, model, {"optimizer": _optimizer_sharded(model, optimizer, True)})
            optimizer.load_state_dict(loaded["optimizer"])
    except (KeyError, RuntimeError, ValueError) as error:
        raise UserError(f"checkpoint {directory}: its optimizer state does not fit this optimizer "
                        f"({type(error).__name__}: {_first_line(error)}); add --no-load-optim to load the "
                        "weights only") from error
    return state


def read_trainer_state(path: str) -> dict:
    try:
        with open(path) as handle:
            state = json.load(handle)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path} ({_first_line(error)}): the checkpoint is damaged; load an "
                        "earlier iteration with --ckpt-step") from error
    if not isinstance(state, dict) or "step" not in state:
        raise UserError(f"{path} is not a trainer state (no 'step'): load an earlier iteration with --ckpt-step")
    return state


def _load(directory: str, model, extra_sharded: Optional[dict] = None) -> dict:
    """Megatron's loader, its failures (a truncated or foreign file, a tensor of another shape)
    turned into one line naming the checkpoint."""
    try:
        return load_checkpoint(directory, model, extra_sharded=extra_sharded)
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        raise UserError(f"cannot load checkpoint {directory} ({type(error).__name__}: {_first_line(error)}); "
                        "it is damaged or of another model: load an earlier iteration with --ckpt-step, "
                        "or another directory") from error


def _first_line(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # torch's CheckpointException: {rank: cause}
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, BaseException):
            return _first_line(cause)
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:300]
