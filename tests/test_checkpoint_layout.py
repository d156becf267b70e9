"""Iteration directories, their manifests and the choice of what to load
(logra_megatron/checkpoint_layout.py), on hand-made directories: no model is built."""

import os

import pytest

from logra_megatron.checkpoint_layout import (TRACKER_FILE, atomic_write_text, incomplete_reason, iteration_dir,
                                              iterations, partial_dir, publish, remove_partials,
                                              select_checkpoint)
from logra_megatron.errors import UserError


def fake_save(root, iteration, payload=b"tensor bytes", finish=True):
    """What a save writes: files in the partial directory, then (``finish``) the publish."""
    directory = partial_dir(root, iteration)
    os.makedirs(os.path.join(directory, "sub"), exist_ok=True)
    with open(os.path.join(directory, "model_config.json"), "w") as handle:
        handle.write("{}")
    with open(os.path.join(directory, "sub", "0_0.distcp"), "wb") as handle:
        handle.write(payload * 10)
    if finish:
        publish(root, iteration)


def test_the_newest_complete_iteration_is_chosen_and_the_tracker_follows(tmp_path):
    root = str(tmp_path)
    for iteration in (10, 20, 30):
        fake_save(root, iteration)
    fake_save(root, 40, finish=False)  # killed before its rename
    assert [i for i, _ in iterations(root)] == [10, 20, 30]
    assert select_checkpoint(root) == (30, iteration_dir(root, 30))
    assert open(os.path.join(root, TRACKER_FILE)).read() == "30"
    remove_partials(root)
    assert not os.path.exists(partial_dir(root, 40)) and os.path.isdir(iteration_dir(root, 30))


@pytest.mark.parametrize("damage", ["truncate", "delete", "no_manifest", "bad_manifest"])
def test_a_damaged_iteration_is_skipped_with_a_warning_naming_it(tmp_path, damage):
    root = str(tmp_path)
    fake_save(root, 1)
    fake_save(root, 2)
    newest = iteration_dir(root, 2)
    tensor = os.path.join(newest, "sub", "0_0.distcp")
    if damage == "truncate":
        os.truncate(tensor, 5)
    elif damage == "delete":
        os.remove(tensor)
    elif damage == "no_manifest":
        os.remove(os.path.join(newest, "manifest.json"))
    else:
        open(os.path.join(newest, "manifest.json"), "w").write("{not json")
    warnings = []
    assert select_checkpoint(root, warn=warnings.append) == (1, iteration_dir(root, 1))
    assert len(warnings) == 1 and newest in warnings[0], warnings
    assert incomplete_reason(newest) is not None and incomplete_reason(iteration_dir(root, 1)) is None
    with pytest.raises(UserError, match="incomplete or corrupt"):  # asked for by --ckpt-step
        select_checkpoint(root, 2)


def test_ckpt_step_picks_one_and_names_what_exists(tmp_path):
    root = str(tmp_path)
    fake_save(root, 5)
    fake_save(root, 7)
    assert select_checkpoint(root, 5) == (5, iteration_dir(root, 5))
    with pytest.raises(UserError, match=r"no such checkpoint .* \(it has 5, 7\)"):
        select_checkpoint(root, 6)


def test_no_complete_iteration_is_an_error_and_an_empty_root_is_nothing(tmp_path):
    root = str(tmp_path)
    assert select_checkpoint(root) is None
    fake_save(root, 3)
    os.truncate(os.path.join(iteration_dir(root, 3), "model_config.json"), 0)
    with pytest.raises(UserError, match="no complete checkpoint"):
        select_checkpoint(root, warn=lambda message: None)


def test_a_single_checkpoint_directory_loads_as_is(tmp_path):
    (tmp_path / "model_config.json").write_text("{}")  # e.g. tools/convert_hf_to_mcore.py output
    assert select_checkpoint(str(tmp_path)) == (None, str(tmp_path))


def test_keep_removes_all_but_the_newest(tmp_path):
    root = str(tmp_path)
    for iteration in range(1, 6):
        fake_save(root, iteration)
    fake_save(root, 6, finish=False)
    publish(root, 6, keep=2)
    assert [i for i, _ in iterations(root)] == [5, 6]


def test_republishing_an_iteration_replaces_it(tmp_path):
    root = str(tmp_path)
    fake_save(root, 4, payload=b"old")
    fake_save(root, 4, payload=b"newer")
    assert select_checkpoint(root) == (4, iteration_dir(root, 4))
    assert os.path.getsize(os.path.join(iteration_dir(root, 4), "sub", "0_0.distcp")) == 50


def test_atomic_write_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "state.json")
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert open(path).read() == "two" and os.listdir(tmp_path) == ["state.json"]
