"""Checkpoint directories the Megatron way: one directory per iteration, complete or absent.

A save root looks like::

    <save>/
        iter_0000040/                      complete: renamed into place after every file was written
            model_config.json, trainer_state.json, manifest.json, *.distcp, .metadata, ...
        iter_0000050/
        iter_0000060.partial/              a save that was interrupted (ignored, removed by the next save)
        latest_checkpointed_iteration.txt  "60" once iter_0000060 is complete (replaced atomically)

An iteration is written under ``iter_NNNNNNN.partial``; ``manifest.json`` (every file's size) is
written last inside it; then the directory is renamed to ``iter_NNNNNNN`` and the tracker file is
replaced (write a temporary file, ``os.replace``), so a process killed at any moment leaves
either the previous complete iterations or the new one, never a half-written directory under a
final name. Loading does not trust the tracker: it scans the complete iterations newest first and
checks each against its manifest (a missing or truncated file fails the check), skipping those
that fail with a warning. ``--keep-checkpoints N`` removes all but the newest N complete ones.

A save root Megatron-LM wrote has the same names without our manifest: one of its iterations is
complete when dist_checkpointing's ``.metadata`` (written after every shard) is there; its
``release/`` directory (tracker ``release``) is a single checkpoint.
"""

import json
import os
import re
import shutil
from typing import Callable, List, Optional, Tuple

from logra_megatron.checkpoint import MODEL_CONFIG_FILE, is_checkpoint_dir
from logra_megatron.errors import UserError

ITERATION_PREFIX = "iter_"
ITERATION_DIGITS = 7  # Megatron's iter_0000100
PARTIAL_SUFFIX = ".partial"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
RELEASE_DIR = "release"  # Megatron-LM's name for a checkpoint outside the iteration sequence
DIST_METADATA_FILE = ".metadata"  # written by dist_checkpointing once every shard is written
_ITERATION_NAME = re.compile(rf"^{ITERATION_PREFIX}(\d{{{ITERATION_DIGITS}}})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"{ITERATION_PREFIX}{iteration:0{ITERATION_DIGITS}d}")


def partial_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + PARTIAL_SUFFIX


def atomic_write_text(path: str, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never a part."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _files(directory: str) -> List[str]:
    found = []
    for base, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(base, name), directory) for name in names]
    return sorted(name for name in found if name != MANIFEST_FILE)


def write_manifest(directory: str) -> None:
    """Record every file's size; written last, so its presence means the writers finished."""
    sizes = {name: os.path.getsize(os.path.join(directory, name)) for name in _files(directory)}
    atomic_write_text(os.path.join(directory, MANIFEST_FILE), json.dumps({"files": sizes}, indent=1))


def incomplete_reason(directory: str) -> Optional[str]:
    """None when ``directory`` holds every file its manifest lists, at the listed size; else why
    not (in words)."""
    path = os.path.join(directory, MANIFEST_FILE)
    try:
        with open(path) as handle:
            sizes = json.load(handle)["files"]
    except FileNotFoundError:
        if _written_by_megatron_lm(directory):
            if os.path.isfile(os.path.join(directory, DIST_METADATA_FILE)):
                return None
            return f"no {DIST_METADATA_FILE} (Megatron-LM's save did not finish)"
        return f"no {MANIFEST_FILE} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_FILE} is unreadable"
    for name, size in sizes.items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        actual = os.path.getsize(file)
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def _written_by_megatron_lm(directory: str) -> bool:
    """Megatron-LM's iteration directory: its args, none of our files."""
    return not os.path.isfile(os.path.join(directory, MODEL_CONFIG_FILE)) and is_checkpoint_dir(directory)


def iterations(root: str) -> List[Tuple[int, str]]:
    """The complete-named iteration directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITERATION_NAME.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def select_checkpoint(root: str, iteration: Optional[int] = None,
                      warn: Callable[[str], None] = print) -> Optional[Tuple[Optional[int], str]]:
    """The checkpoint ``--load root [--ckpt-step iteration]`` means: ``(iteration, directory)``.

    ``root`` may also be a single checkpoint directory (e.g. one written by
    tools/convert_hf_to_mcore.py, or one iteration of Megatron-LM's): ``(None, root)``; or a
    Megatron-LM root whose tracker says ``release``: ``(None, root/release)``. Without ``iteration``, the newest complete
    iteration; incomplete or corrupt ones are skipped with a warning naming them. None when
    ``root`` holds no checkpoint at all.
    """
    found = iterations(root)
    if not found:
        if iteration is not None:
            raise UserError(f"--ckpt-step {iteration}: {root} holds no iteration checkpoints")
        if is_checkpoint_dir(root):
            return None, root
        release = os.path.join(root, RELEASE_DIR)
        if os.path.isdir(release) and is_checkpoint_dir(release):
            return None, release
        return None
    if iteration is not None:
        chosen = dict(found).get(iteration)
        if chosen is None:
            have = ", ".join(str(i) for i, _ in found)
            raise UserError(f"--ckpt-step {iteration}: no such checkpoint in {root} (it has {have})")
        reason = incomplete_reason(chosen)
        if reason:
            raise UserError(f"checkpoint {chosen} is incomplete or corrupt: {reason}; "
                            "pick another with --ckpt-step or omit it to take the latest complete one")
        return iteration, chosen
    for number, directory in reversed(found):
        reason = incomplete_reason(directory)
        if reason is None:
            return number, directory
        warn(f"warning: skipping checkpoint {directory}: {reason}")
    raise UserError(f"no complete checkpoint in {root}: every iteration directory failed its manifest "
                    "check (see the warnings above); remove them or load another directory")


def remove_partials(root: str) -> None:
    """Delete what interrupted saves left (rank 0, before a new save)."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(ITERATION_PREFIX) and name.endswith(PARTIAL_SUFFIX):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def publish(root: str, iteration: int, keep: int = 0) -> str:
    """Rename the finished partial directory into place, point the tracker at it, and keep the
    newest ``keep`` complete iterations (0: all). Rank 0 only, after every rank wrote."""
    source, target = partial_dir(root, iteration), iteration_dir(root, iteration)
    write_manifest(source)
    if os.path.isdir(target):  # a second save of the same iteration (a resumed run's end)
        shutil.rmtree(target)
    os.replace(source, target)
    _fsync_directory(root)
    atomic_write_text(os.path.join(root, TRACKER_FILE), str(iteration))
    if keep > 0:
        for _, old in iterations(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _fsync_directory(path: str) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
