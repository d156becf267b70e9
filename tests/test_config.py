"""The config schema: one set of defaults (Python == CLI), bad values of every component fail
early in one line, --help grouped by component, YAML keys mirror the flags."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest
from dist_harness import REPO

from logra_megatron import schema
from logra_megatron.config import SECTIONS, build_parser, parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.rl.config import TrainConfig, resolve

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _flatten(value, prefix=""):
    if dataclasses.is_dataclass(value):
        out = {}
        for item in dataclasses.fields(value):
            out.update(_flatten(getattr(value, item.name), f"{prefix}{item.name}."))
        return out
    return {prefix.rstrip("."): value}


def test_python_defaults_equal_cli_defaults_field_by_field():
    from_python = _flatten(resolve(TrainConfig(), world_size=1))
    from_cli = _flatten(parse_train_args([], world_size=1))
    assert from_python.keys() == from_cli.keys()
    for key in from_python:
        assert from_python[key] == from_cli[key], key
    # Not trivially equal: the defaults are the documented embedded run.
    assert from_cli["optimizer.lr"] == 3e-4 and from_cli["kl.probe_sequences"] == 8
    assert from_cli["kl.realized_interval"] == 5 and from_cli["task.max_operand"] == 19
    assert from_cli["task.held_out_fraction"] == 0.3 and from_cli["logra.rank"] == 0.5
    assert from_cli["logra.max_rank"] == 256
    assert from_cli["model_config.vocab"] < 256  # the tokenizer's vocabulary was applied


def test_every_option_is_a_flag_once_and_help_groups_them():
    parser = build_parser()
    flags = [s for action in parser._actions for s in action.option_strings]
    assert len(flags) == len(set(flags))
    text = parser.format_help()
    for _, title in SECTIONS:
        assert f"\n{title}:" in text, title
    for flag in ("--tensor-model-parallel-size", "--lr", "--logra-rank", "--kl-target", "--top-p",
                 "--group-size", "--rollout-engine", "--use-distributed-optimizer", "--no-progress"):
        assert flag in flags
    # Megatron's flags, with Megatron's meanings (tests/test_megatron_flags.py says which).
    for flag in ("--seq-length", "--global-batch-size", "--exit-signal-handler", "--ckpt-format"):
        assert flag in flags


def test_flags_reach_their_section():
    config = parse_train_args(["--top-k", "5", "--group-size", "4", "--no-std-normalization",
                               "--use-distributed-optimizer", "--seed", "7", "--no-progress"], world_size=1)
    assert config.sampling.top_k == 5 and config.advantages.group_size == 4
    assert config.advantages.normalize_std is False and config.optimizer.distributed is True
    assert config.run.progress is False
    assert config.logra.seed == 7 and config.task.seed == 7  # derived from --seed


@pytest.mark.parametrize("args,message", [
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be >= 0"),
    (["--kl-target", "-1"], "--kl-target must be > 0"),
    (["--group-size", "0"], "--group-size must be >= 1"),
    (["--rollout-engine", "nope"], "unknown rollout engine 'nope'"),
    (["--clip-low", "1.5"], "--clip-low must be in [0, 1)"),
    (["--adam-beta1", "1.0"], "--adam-beta1 must be in [0, 1)"),
    (["--lr-decay-style", "step"], "invalid choice: 'step'"),
    (["--max-operand", "0"], "--max-operand must be >= 1"),
    (["--warmup-iters", "-2"], "--warmup-iters must be >= 0"),
])
def test_bad_values_of_every_component_fail_fast_in_one_line(args, message):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.train", *args], capture_output=True,
                          text=True, timeout=60, env=ENV, cwd=REPO)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr
    assert elapsed < 10, elapsed


def test_bad_values_fail_before_any_process_group():
    import torch.distributed as dist

    from logra_megatron import parallel

    parallel.destroy()  # an earlier test of this process may have started one
    for args in (["--top-p", "0"], ["--group-size", "0"], ["--tensor-model-parallel-size", "2"]):
        with pytest.raises(UserError):
            parse_train_args(args, world_size=1)
    assert not dist.is_initialized()


def test_yaml_covers_every_flag_with_type_checks(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("top_k: 3\nno-std-normalization: true\nlogra-rank: 16\nrollout-engine: megatron\n"
                    "warmup_min_lr: 1.0e-4\n")
    config = parse_train_args(["--config", str(path)], world_size=1)
    assert config.sampling.top_k == 3 and config.advantages.normalize_std is False
    assert config.logra.rank == 16 and config.warmup.min_lr == 1e-4
    for text in ("top_k: 2.5\n", "no-progress: 3\n", "lr: true\n", "group-size: [1]\n"):
        path.write_text(text)
        with pytest.raises(UserError, match="invalid value"):
            parse_train_args(["--config", str(path)], world_size=1)


def test_every_section_field_has_a_documented_default():
    for section, _ in SECTIONS:
        cls = {item.name: item.type for item in dataclasses.fields(TrainConfig)}[section]
        for item, spec in schema.options_of(cls):
            assert spec["help"], (section, item.name)
            assert item.default is not dataclasses.MISSING or item.default_factory is not dataclasses.MISSING


def test_the_default_rank_is_half_the_dimension_at_most_256():
    """``--logra-rank 0.5 --logra-max-rank 256``: tiny's weights (hidden 64) keep their half,
    smollm2-135m's (576) and qwen2.5-32b's (5120) stop at 256; 0 lifts the cap; an integer rank
    is taken as given."""
    from logra_megatron.logra.config import DEFAULT_MAX_RANK, DEFAULT_RANK, LogRAConfig

    default = LogRAConfig()
    assert (default.rank, default.max_rank) == (DEFAULT_RANK, DEFAULT_MAX_RANK) == (0.5, 256)
    assert [default.rank_for(dim, "w") for dim in (64, 576, 5120)] == [32, 256, 256]
    assert LogRAConfig(max_rank=0).rank_for(5120, "w") == 2560
    assert LogRAConfig(rank=512).rank_for(5120, "w") == 512
    assert LogRAConfig(rank=0.25, max_rank=100).rank_for(576, "w") == 100
    config = parse_train_args(["--logra-max-rank", "64"], world_size=1)
    assert config.logra.max_rank == 64 and config.logra.rank == 0.5


def test_the_planner_smoke_job_and_benchmarks_take_the_trainers_rank_default(monkeypatch):
    import argparse
    import importlib.util

    from logra_megatron.logra.config import LogRAConfig, rank_settings
    from logra_megatron.planning.arguments import add_arguments
    from logra_megatron.smoke import parse_args as smoke_args

    trainer = parse_train_args([], world_size=1).logra
    planner = argparse.ArgumentParser()
    add_arguments(planner)
    parsed = [planner.parse_args([]), smoke_args([])]
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # the tools import their shared module
    for tool in ("benchmark_optimizer", "benchmark_step_phases"):
        spec = importlib.util.spec_from_file_location(tool, REPO / "tools" / f"{tool}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parsed.append(module.parse_args([]))
    for args in parsed:
        assert LogRAConfig(**rank_settings(args)) == LogRAConfig(rank=trainer.rank, max_rank=trainer.max_rank)


@pytest.mark.parametrize("entry", [
    ["-m", "logra_megatron.train"], ["-m", "logra_megatron.smoke"], ["tools/plan_memory.py", "--preset", "tiny"],
    ["tools/benchmark_optimizer.py"], ["tools/benchmark_step_phases.py"]])
def test_a_negative_rank_cap_is_one_error_line_everywhere(entry):
    proc = subprocess.run([sys.executable, *entry, "--logra-max-rank", "-1"], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --logra-max-rank must be an integer >= 0 (0: no cap), got -1", proc.stderr
