"""One flag vocabulary (issue 35, item 5): a flag the config schema owns (an option of a section of
``TrainConfig``, logra_megatron/schema.py) means one thing in every entry point. Each entry point's
parser is built and every action that answers to a schema flag must come from the schema
(``add_arguments``/``add_flags``/``add_alias`` mark what they declare) with the schema's help, and
its default must be the schema's, unless the entry point chose its own through ``add_flags(defaults=)``,
which the help then states. A hand-written ``add_argument("--lr", default=1e-4)`` fails here, and
so does a later ``set_defaults`` or a changed help."""

import argparse
import importlib
import importlib.util
import sys

import pytest
from dist_harness import REPO

from logra_megatron import schema
from logra_megatron.config import SECTIONS, _section_class
from logra_megatron.rl.config import RolloutConfig, RunConfig
from logra_megatron.training.config import OptimizerSettings


def _owned() -> dict:
    """Every flag the schema owns -> (config class, field)."""
    owned = {}
    for section, _ in SECTIONS:
        config_class = _section_class(section)
        for flag, item in schema.flags_of(config_class).items():
            owned[flag] = (config_class, item)
    return owned


OWNED = _owned()


def _script(path: str):
    """A script's module, loaded from its file (tools/ scripts import their neighbours by name)."""
    sys.path.insert(0, str(REPO / "tools"))
    name = "entry_" + path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENTRY_POINTS = {
    "logra_megatron.train": lambda: importlib.import_module("logra_megatron.config").build_parser(),
    "logra_megatron.evaluate": lambda: importlib.import_module("logra_megatron.evaluate").build_parser(),
    "examples/megatron_loop.py": lambda: _script("examples/megatron_loop.py").build_parser(),
    "tools/benchmark_peers.py": lambda: _script("tools/benchmark_peers.py").build_parser(),
    "tools/benchmark_policy_sync.py": lambda: _script("tools/benchmark_policy_sync.py").build_parser(),
    "tools/kl_control_demo.py": lambda: _script("tools/kl_control_demo.py").build_parser(),
    "tools/scaling_sweep.py": lambda: _script("tools/scaling_sweep.py").build_parser(),
    "tools/single_gpu_rl_step.py": lambda: _script("tools/single_gpu_rl_step.py").build_parser(),
}


def _parsers(parser):
    """``parser`` and its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def problems(parser) -> list:
    """Where ``parser`` (and its subcommands) says something else than the schema about a flag the
    schema owns; empty when it says the same."""
    found = []
    for one in _parsers(parser):
        required = any(action.required for action in one._actions)
        parsed = None if required else one.parse_args([])  # what an empty command line gives
        for action in one._actions:
            for flag in (text for text in action.option_strings if text in OWNED):
                config_class, item = OWNED[flag]
                declared = getattr(action, "declared", None)
                if declared is None or (declared.config_class, declared.field) != (config_class, item.name):
                    found.append(f"{flag}: declared by hand, not from {config_class.__name__}.{item.name}")
                    continue
                if flag == schema.positive_flag_of(item):  # Megatron's spelling of a switch: its own help
                    continue
                if not (action.help or "").startswith(schema.help_of(item)):
                    found.append(f"{flag}: help {action.help!r} is not the schema's {schema.help_of(item)!r}")
                if action.default is argparse.SUPPRESS:  # add_arguments: the dataclass applies its default
                    continue
                if declared.own_default:
                    if "(here: " not in action.help:
                        found.append(f"{flag}: its own default {action.default!r} is not stated in its help")
                elif action.default != schema.default_of(item):
                    found.append(f"{flag}: default {action.default!r}, the schema's is {schema.default_of(item)!r}")
                if parsed is not None and getattr(parsed, action.dest) != action.default:
                    found.append(f"{flag}: an empty command line gives {getattr(parsed, action.dest)!r}, "
                                 f"not its default {action.default!r}")
    return found


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_the_schemas_flags(entry_point):
    assert problems(ENTRY_POINTS[entry_point]()) == []


def test_the_batch_and_shape_flags_of_the_tools_come_from_the_schema():
    # Not only no conflict: the flags the brief names are there, declared by the schema.
    expected = {
        "examples/megatron_loop.py": ("--preset", "--seq-length", "--global-batch-size", "--micro-batch-size",
                                      "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--bf16",
                                      "--lr", "--min-lr", "--lr-decay-style", "--train-iters", "--optimizer",
                                      "--logra-rank", "--use-distributed-optimizer", "--overlap-grad-reduce",
                                      "--save", "--load"),
        "tools/benchmark_peers.py": ("--preset", "--bf16", "--seq-length", "--global-batch-size",
                                     "--micro-batch-size", "--lr", "--clip-grad", "--seed"),
        "tools/benchmark_policy_sync.py": ("--preset", "--bf16", "--num-attention-heads", "--logra-rank",
                                           "--logra-max-rank", "--logra-embeddings"),
        "tools/kl_control_demo.py": ("--lr", "--kl-target", "--kl-probe-sequences", "--seed"),
        "tools/single_gpu_rl_step.py": ("--preset", "--seq-length", "--kl-probe-sequences", "--seed"),
    }
    for entry_point, flags in expected.items():
        actions = ENTRY_POINTS[entry_point]()._option_string_actions
        for flag in flags:
            assert getattr(actions.get(flag), "declared", None) is not None, (entry_point, flag)


def test_the_check_finds_a_redeclared_flag_a_changed_default_and_a_changed_help():
    parser = argparse.ArgumentParser()
    schema.add_flags(parser, RunConfig, "seed", "train_iters")
    schema.add_flags(parser, OptimizerSettings, "lr", defaults={"lr": 1e-4})  # on purpose: stated in the help
    assert problems(parser) == []
    parser.add_argument("--seq-length", type=int, default=64)  # by hand, with a default of its own
    parser.set_defaults(seed=7)  # the schema's flag, its default changed afterwards
    next(action for action in parser._actions if "--train-iters" in action.option_strings).help = "steps"
    found = problems(parser)
    assert len(found) == 3, found
    assert found[0].startswith("--seed: default 7, the schema's is 1234")
    assert found[1].startswith("--train-iters: help 'steps' is not the schema's")
    assert found[2] == "--seq-length: declared by hand, not from RolloutConfig.seq_length"


def test_validate_flags_refuses_what_the_trainer_refuses():
    from logra_megatron.errors import UserError

    parser = argparse.ArgumentParser()
    schema.add_flags(parser, RolloutConfig, "global_batch_size", defaults={"global_batch_size": 4})
    schema.add_flags(parser, RunConfig, "micro_batch_size", defaults={"micro_batch_size": 2})
    schema.validate_flags(parser, parser.parse_args([]))
    with pytest.raises(UserError, match="--micro-batch-size must be >= 1, got 0"):
        schema.validate_flags(parser, parser.parse_args(["--micro-batch-size", "0"]))
    with pytest.raises(UserError, match="--global-batch-size must be >= 1, got -1"):
        schema.validate_flags(parser, parser.parse_args(["--global-batch-size", "-1"]))


def test_evaluates_samples_is_eval_samples():
    from logra_megatron.evaluate import build_parser

    parser = build_parser()
    for argv in (["--samples", "4"], ["--samples=4"], ["--eval-samples", "4"]):
        assert schema.values_for(parser.parse_args(argv), "run", RunConfig) == {"eval_samples": 4}, argv
    assert "short for --eval-samples" in parser.format_help()
