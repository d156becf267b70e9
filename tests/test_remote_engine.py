"""A second rollout engine is one file plus its worker: tests/plugins/echo_engine.py (with
echo_worker.py), outside the package, built on logra_megatron/rollout/remote_engine.py and
chosen by ``module:attr``. Run by a trainer on 2 ranks (TP=2) in tests/workers/echo_engine_checks.py:
the base delivers the full and the low-rank syncs to the worker under Hugging Face names, and
broadcasts the engine's rows to both ranks. The trainer takes it by ``--rollout-engine`` alone."""

import json
import os
import subprocess
import sys

import pytest

from dist_harness import REPO, result, run_workers

PLUGINS = REPO / "tests" / "plugins"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("echo_engine_checks.py", 2, tmp_path_factory.mktemp("echo_engine"))


def test_the_registry_takes_the_engine_by_module_and_attribute(monkeypatch):
    from logra_megatron.rollout.engine import ROLLOUT_ENGINES
    from logra_megatron.rollout.remote_engine import RemoteEngine

    monkeypatch.syspath_prepend(str(PLUGINS))
    engine_class = ROLLOUT_ENGINES.get("echo_engine:EchoEngine")
    assert issubclass(engine_class, RemoteEngine) and engine_class.name == "echo"


def test_the_low_rank_sync_flag_takes_any_remote_engine(monkeypatch):
    """``--policy-sync lowrank`` is for engines with their own weights: the base class says so,
    not a list of names (the in-trainer Megatron engine is refused)."""
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import UserError

    monkeypatch.syspath_prepend(str(PLUGINS))
    config = parse_train_args(["--rollout-engine", "echo_engine:EchoEngine", "--policy-sync", "lowrank",
                               "--optimizer", "logra"], world_size=1)
    assert config.rollout.policy_sync == "lowrank"
    with pytest.raises(UserError, match="the megatron engine samples from the trainer's weights"):
        parse_train_args(["--rollout-engine", "megatron", "--policy-sync", "lowrank", "--optimizer", "logra"],
                         world_size=1)


def test_a_full_sync_reaches_the_worker_under_hf_names(results):
    found = result(results, "echo", 0)
    assert found["class"] == "EchoEngine" and found["separate_process"]
    assert found["full"]["same_names"] and found["full"]["count"] > 5
    assert found["full"]["gap"] <= 1e-6, found["full"]
    assert found["full_bytes"] > 0
    assert result(results, "echo", 1)["full"] is None  # only the engine's rank talks to the worker


def test_a_low_rank_sync_reaches_the_worker(results):
    found = result(results, "echo", 0)
    assert found["kinds"] == [0.0, 1.0]  # a full sync after the step that drew projections, then low rank
    assert found["after_low_rank"]["same_names"]
    assert found["after_low_rank"]["gap"] <= 1e-4, found["after_low_rank"]


def test_every_rank_gets_the_engines_rows(results):
    first, second = result(results, "echo", 0), result(results, "echo", 1)
    assert first["rows_before"] == second["rows_before"]
    assert first["rows_after"] == second["rows_after"]
    assert len(first["rows_before"]) == 6 and all(first["rows_before"])
    assert first["rows_after"] != first["rows_before"]  # the worker samples from the synced weights


def test_the_trainer_runs_the_engine_by_flag_only(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(PLUGINS)]))
    args = ["--rollout-engine", "echo_engine:EchoEngine", "--warmup-iters", "0", "--train-iters", "2",
            "--eval-prompts", "4", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
            "--micro-batch-size", "8", "--kl-probe-sequences", "2", "--no-progress", "--output-dir", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 2
    synced = summary["weight_sync"]
    assert synced["syncs"] == 2 and synced["restarts"] == 0  # one sync after each step, none failed
    assert synced["bytes"] == 2 * synced["full_sync_bytes"] > 0
