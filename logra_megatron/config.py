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
import difflib
import os
import sys
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
    ("recompute", "activation recomputation"),
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


def build_parser(prog: str = "logra_megatron.train",
                 description: str = "GRPO post-training on Megatron-Core with LoGRA.") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=description)
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
            if schema.positive_flag_of(item):  # Megatron's spelling of a switch: its value is the field's
                positive = schema.positive_flag_of(item).lstrip("-")
                keys[positive] = keys[positive.replace("-", "_")] = (section, item)
    return keys


def _short(value, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        text = f"<a number of more than {sys.get_int_max_str_digits()} digits>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _yaml_loader():
    import yaml  # a declared dependency, needed only with --config

    class StrictLoader(yaml.SafeLoader):
        """PyYAML's safe loader, except that a key given twice in one mapping is an error (the
        safe loader keeps the last value silently)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the safe loader reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {_short(key)} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml, StrictLoader


def _yaml_problem(error) -> str:
    """One line saying what is wrong in a YAML file, and where."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"


def _read_yaml(path: str) -> Dict[str, dict]:
    """The sections a YAML config file sets. Anything but a readable UTF-8 file holding one
    mapping of known flag names to valid values is a :class:`UserError` naming the file."""
    yaml, loader = _yaml_loader()

    if not path:
        raise UserError("--config needs the path of a YAML file")
    if os.path.isdir(path):
        raise UserError(f"--config {path} is a directory, not a YAML file")
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error.strerror or error}") from None
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data  # a UTF-8 byte-order mark
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise UserError(f"config file {path} is not UTF-8 text (byte 0x{data[error.start]:02x} on line "
                        f"{line}); save it as UTF-8") from None
    try:
        values = yaml.load(text, Loader=loader)
    except yaml.YAMLError as error:
        raise UserError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from None
    except RecursionError:
        raise UserError(f"config file {path} is nested too deeply to be a config") from None
    except ValueError as error:  # a value PyYAML cannot build (an int of more than 4300 digits)
        raise UserError(f"config file {path} holds a value that cannot be read: "
                        f"{str(error).splitlines()[0].split(';')[0]}") from None
    if values is None:
        raise UserError(f"config file {path} is empty: write flag names without dashes as keys "
                        f"(e.g. 'lr: 3.0e-4')")
    if not isinstance(values, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(values), f"a {type(values).__name__}")
        raise UserError(f"config file {path} must be a mapping of flag names to values, not {kind} "
                        f"(e.g. 'lr: 3.0e-4')")
    known = _yaml_keys()
    sections: Dict[str, dict] = {}
    given: Dict[str, str] = {}  # section.field -> the key that set it
    for key, value in values.items():
        name = str(key).lstrip("-")
        if name not in known:
            hint = ""
            if name in {section for section, _ in SECTIONS}:
                hint = "; keys are flag names without dashes, not nested under sections"
            else:
                close = difflib.get_close_matches(name, [k for k in known if "_" not in k], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"config file {path}: unknown key {_short(key)}{hint} (see --help for the flags)")
        section, item = known[name]
        if f"{section}.{item.name}" in given:
            raise UserError(f"config file {path}: {given[f'{section}.{item.name}']} and {key} set the same "
                            f"option; keep one")
        given[f"{section}.{item.name}"] = str(key)
        try:
            parsed = schema.yaml_value(item, value)
            if name.replace("_", "-") == (schema.positive_flag_of(item) or "").lstrip("-"):
                parsed = not parsed  # yaml_value reads a negative switch's key; this key says the value itself
            sections.setdefault(section, {})[item.name] = parsed
        except (TypeError, ValueError, ArithmeticError, UserError) as error:
            reason = str(error).splitlines()[0] if str(error) else "invalid value"
            raise UserError(f"config file {path}: {key} has an invalid value {_short(value)} ({reason})") from None
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


def parse_train_args(argv=None, world_size: int = None, parser: ArgumentParser = None) -> TrainConfig:
    """Flags (+ optional YAML) -> a validated, resolved TrainConfig. Raises UserError; argparse
    errors exit 2 with one line. ``parser``: another entry point's (default: the trainer's)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    base = _read_yaml(args.config) if args.config is not None else None
    return resolve(config_from_namespace(args, base), world_size)
