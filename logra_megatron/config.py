"""Flags and YAML files -> a validated :class:`~logra_megatron.rl.config.TrainConfig`.

Every flag is derived from a field of a component config (``logra_megatron/schema.py``), so a
default, a help text and a flag name are written once, on the field; ``--help`` lists the flags
grouped by component. ``--config FILE.yaml`` supplies values whose keys are the flag names
without the leading dashes (``lr``, ``tensor-model-parallel-size`` or
``tensor_model_parallel_size``); flags on the command line override them. The whole config,
including the model (preset or ``--load``), the tokenizer's vocabulary and the layout, is built
and validated here, before any process group starts: a bad value is one ``error:`` line.
"""

import argparse
import dataclasses
import os
from typing import Dict, Tuple

from logra_megatron import schema
from logra_megatron.cli import ArgumentParser
from logra_megatron.errors import UserError
from logra_megatron.rl.config import TrainConfig, resolve

# (section of TrainConfig, --help title) in the order --help shows them.
SECTIONS = (
    ("model", "model and tokenizer"),
    ("checkpoint", "checkpoints"),
    ("parallel", "parallelism"),
    ("optimizer", "optimizer"),
    ("lr_schedule", "learning-rate schedule"),
    ("logra", "LoGRA"),
    ("kl", "predicted-KL control"),
    ("rollout", "rollouts"),
    ("sampling", "sampling"),
    ("advantages", "GRPO advantages"),
    ("loss", "GRPO policy loss"),
    ("task", "task"),
    ("reward", "reward"),
    ("warmup", "supervised warm-up"),
    ("run", "run"),
)


def _section_class(name: str):
    return {item.name: item.type for item in dataclasses.fields(TrainConfig)}[name]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="logra_megatron.train",
                            description="GRPO post-training on Megatron-Core with LoGRA.")
    parser.add_argument("--config", help="YAML file whose keys mirror these flags (flags override it)")
    for section, title in SECTIONS:
        cls = _section_class(section)
        schema.add_arguments(parser, section, cls, title, (cls.__doc__ or "").split("\n\n")[0].strip())
    return parser


def _yaml_keys() -> Dict[str, Tuple[str, dataclasses.Field]]:
    """YAML key (flag name without dashes, with ``-`` or ``_``) -> (section, field)."""
    keys = {}
    for section, _ in SECTIONS:
        for item, _spec in schema.options_of(_section_class(section)):
            name = schema.flag_of(item).lstrip("-")
            keys[name] = keys[name.replace("-", "_")] = (section, item)
    return keys


def _read_yaml(path: str) -> Dict[str, dict]:
    import yaml  # a declared dependency, needed only with --config

    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
    except yaml.YAMLError as error:
        raise UserError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UserError(f"config file {path} must be a mapping of flag names to values")
    known = _yaml_keys()
    sections: Dict[str, dict] = {}
    for key, value in values.items():
        name = str(key).lstrip("-")
        if name not in known:
            raise UserError(f"config file {path}: unknown key {key!r}")
        section, item = known[name]
        try:
            sections.setdefault(section, {})[item.name] = schema.yaml_value(item, value)
        except (TypeError, ValueError, UserError) as error:
            reason = str(error).splitlines()[0] if str(error) else "invalid value"
            raise UserError(f"config file {path}: {key} has an invalid value {value!r} ({reason})") from None
    return sections


def config_from_namespace(args: argparse.Namespace, base: Dict[str, dict] = None) -> TrainConfig:
    """A TrainConfig from parsed flags over ``base`` values (from YAML); not yet resolved."""
    sections = {}
    for section, _ in SECTIONS:
        cls = _section_class(section)
        values = dict((base or {}).get(section, {}))
        values.update(schema.values_for(args, section, cls))
        sections[section] = cls(**values)
    return TrainConfig(**sections)


def parse_train_args(argv=None, world_size: int = None) -> TrainConfig:
    """Flags (+ optional YAML) -> a validated, resolved TrainConfig. Raises UserError; argparse
    errors exit 2 with one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    base = _read_yaml(args.config) if args.config else None
    return resolve(config_from_namespace(args, base), world_size)
