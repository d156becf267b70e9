"""Config dataclasses as the one source of flags, YAML keys, defaults and help.

A component config is a frozen dataclass whose user-facing fields are declared with
:func:`option`: the default, the help text and (when it differs from the field name) the
Megatron-style flag are written there once. :func:`add_arguments` derives the argparse flags of
a dataclass from those fields, :func:`values_for` collects what the command line (or a YAML
file) set, and the dataclass itself applies its defaults and validates in ``__post_init__``.
So ``Config()`` built in Python and ``Config`` parsed from an empty command line are the same.

The other entry points (the evaluation, the smoke job, the benchmarks, the example loop) declare
the options they take with :func:`add_flags` (the trainer's flag, parser, choices and help; the
schema's default unless the entry point gives its own on purpose, which the help then states) and
check the values with :func:`validate_flags` (the dataclasses' own checks). Every action these
functions create is marked :class:`Declared`, so tests/test_flag_vocabulary.py can tell a flag the
schema owns that an entry point wrote by hand.

Fields declared without :func:`option` are not flags: they are filled by the code that builds
the config (a tokenizer's ids, a seed derived from ``--seed``).

Only the standard library is used here: this module sits at the bottom of the package.
"""

import argparse
import dataclasses
import json
import math
import typing
from typing import Any, Callable, Dict, Optional, Sequence

_KEY = "logra_option"


def option(default: Any = dataclasses.MISSING, *, help: str, flag: Optional[str] = None,
           choices: Optional[Sequence] = None, parse: Optional[Callable[[str], Any]] = None,
           negative: bool = False, default_factory: Any = dataclasses.MISSING,
           positive_flag: Optional[str] = None):
    """A dataclass field that is also a command-line flag and a YAML key.

    ``flag`` defaults to ``--<field-name-with-dashes>``. ``parse`` turns the flag's text into a
    value (default: from the field's type). A bool field is a switch: ``--flag`` sets True, or
    with ``negative=True`` (for a field that defaults to True) the flag sets it False, as
    ``--no-progress`` does. ``positive_flag`` (a negative switch only) is a second flag that sets
    the field True, its default: Megatron spells some switches that are on here by default
    (``--exit-signal-handler``), and a Megatron command line that passes them must parse.
    """
    if positive_flag is not None and not negative:
        raise TypeError("positive_flag is the other spelling of a negative switch")
    metadata = {_KEY: {"help": help, "flag": flag, "choices": tuple(choices) if choices else None,
                       "parse": parse, "negative": negative, "positive_flag": positive_flag}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def options_of(config_class) -> list:
    """``(field, spec)`` for every :func:`option` field of a dataclass, in declaration order."""
    return [(item, item.metadata[_KEY]) for item in dataclasses.fields(config_class) if _KEY in item.metadata]


def flag_of(item: dataclasses.Field) -> str:
    return item.metadata[_KEY]["flag"] or "--" + item.name.replace("_", "-")


def help_of(item: dataclasses.Field) -> str:
    """An option's help text. ``help`` may be a function returning it, for a flag whose help is
    generated from a :class:`Registry` that fills after the option is declared."""
    text = item.metadata[_KEY]["help"]
    return text() if callable(text) else text


def positive_flag_of(item: dataclasses.Field) -> Optional[str]:
    """A negative switch's second, Megatron-spelled flag (``--exit-signal-handler``), or None."""
    return item.metadata[_KEY].get("positive_flag")


def _default_of(item: dataclasses.Field):
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None


def _base_type(annotation):
    """``Optional[int]`` -> int; other unions are left as they are."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return args[0]
    return annotation


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value of the right type that no option accepts (a float that is not finite). As an
    ``ArgumentTypeError`` argparse reports its message on the flag; as a ``ValueError`` the
    YAML reader reports it on the key."""


def finite_float(text) -> float:
    """A float option's value: any finite number (``nan``, ``inf`` and numbers beyond the float
    range are refused, so no check downstream has to think about them)."""
    try:
        value = float(text)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not math.isfinite(value):
        shown = str(text) if len(str(text)) <= 24 else str(text)[:21] + "..."
        raise BadValue(f"must be a finite number, got {shown!r}")
    return value


finite_float.__name__ = "float"  # argparse: "invalid float value: 'abc'"


def parser_of(item: dataclasses.Field) -> Callable[[str], Any]:
    spec = item.metadata[_KEY]
    if spec["parse"] is not None:
        return spec["parse"]
    kind = _base_type(item.type)
    if kind is float:
        return finite_float
    if kind in (int, str):
        return kind
    raise TypeError(f"option {item.name} of type {item.type} needs parse=")


def _dest(section: str, item: dataclasses.Field) -> str:
    return f"{section}.{item.name}"


@dataclasses.dataclass(frozen=True)
class Declared:
    """What :func:`add_arguments`, :func:`add_flags` and :func:`add_alias` leave on each argparse
    action they create (as ``action.declared``): the option it stands for, and whether the entry
    point chose its own default on purpose (``add_flags(defaults=...)``). A flag the schema owns
    on an action without it was written by hand (tests/test_flag_vocabulary.py looks)."""

    config_class: type
    field: str
    own_default: bool = False


def _declare(action: argparse.Action, config_class, item: dataclasses.Field, own_default: bool = False):
    action.declared = Declared(config_class, item.name, own_default)
    return action


def flags_of(config_class) -> Dict[str, dataclasses.Field]:
    """Every flag ``config_class``'s options own (a negative switch's Megatron spelling too) -> its field."""
    owned = {}
    for item, _spec in options_of(config_class):
        owned[flag_of(item)] = item
        if positive_flag_of(item):
            owned[positive_flag_of(item)] = item
    return owned


def default_of(item: dataclasses.Field):
    """An option's default, as the dataclass applies it."""
    return _default_of(item)


def add_arguments(parser: argparse.ArgumentParser, section: str, config_class, title: str,
                  description: Optional[str] = None) -> None:
    """Add one argument group: a flag per :func:`option` field of ``config_class``. Defaults are
    not stored in argparse (``SUPPRESS``), so only what the user gave reaches
    :func:`values_for`; help shows the dataclass default."""
    group = parser.add_argument_group(title, description)
    for item, spec in options_of(config_class):
        default = _default_of(item)
        common = dict(dest=_dest(section, item), default=argparse.SUPPRESS)
        if _base_type(item.type) is bool:
            action = "store_false" if spec["negative"] else "store_true"
            _declare(group.add_argument(flag_of(item), action=action, help=help_of(item), **common),
                     config_class, item)
            if spec.get("positive_flag"):
                _declare(group.add_argument(spec["positive_flag"], action="store_true",
                                            help=f"accepted for Megatron command lines: the default (see "
                                                 f"{flag_of(item)})", **common), config_class, item)
            continue
        shown = "" if default in (None, "") else f" (default: {default})"
        _declare(group.add_argument(flag_of(item), type=parser_of(item), choices=spec["choices"],
                                    help=help_of(item) + shown, metavar=_metavar(item, spec), **common),
                 config_class, item)


def add_alias(parser: argparse.ArgumentParser, section: str, config_class, name: str, flag: str) -> None:
    """A second, shorter spelling of an option :func:`add_arguments` declared (the evaluation's
    ``--samples`` for ``--eval-samples``): the same field, parser and choices, so it sets the same
    value and is checked the same way."""
    item, spec = next((item, spec) for item, spec in options_of(config_class) if item.name == name)
    if _base_type(item.type) is bool:
        raise TypeError("add_alias takes a valued option, not a switch")
    _declare(parser.add_argument(flag, dest=_dest(section, item), default=argparse.SUPPRESS, type=parser_of(item),
                                 choices=spec["choices"], metavar=_metavar(item, spec),
                                 help=f"short for {flag_of(item)}"), config_class, item)


def add_flags(parser: argparse.ArgumentParser, config_class, *names: str,
              defaults: Optional[Dict[str, Any]] = None, notes: Optional[Dict[str, str]] = None) -> None:
    """Declare some of ``config_class``'s options on an entry point other than the trainer (the
    smoke job, the benchmarks): the trainer's flag, parser, choices and help, so a flag means one
    thing everywhere. The default is the schema's unless ``defaults`` gives the entry point's own
    by field name (a benchmark that times control turns it on; one that must cross a refresh
    sets the interval), and the help then says so (``notes``: how, where the value alone does
    not). Values land under argparse's usual names (``--logra-master`` -> ``args.logra_master``),
    set whether given or not; :func:`validate_flags` checks them as the trainer does. Every action
    is marked :class:`Declared`, with ``own_default`` for those in ``defaults``."""
    defaults, notes = defaults or {}, notes or {}
    fields = {item.name: (item, spec) for item, spec in options_of(config_class)}
    unknown = [name for name in (*names, *defaults) if name not in fields]
    if unknown:
        raise TypeError(f"{config_class.__name__} has no option {', '.join(unknown)}")
    for name in names:
        item, spec = fields[name]
        own = name in defaults
        default = defaults[name] if own else _default_of(item)
        note = f" (here: {notes.get(name, default)})" if own else (
            "" if default in (None, "") else f" (default: {default})")
        if _base_type(item.type) is bool:
            action = "store_false" if spec["negative"] else "store_true"
            _declare(parser.add_argument(flag_of(item), action=action, default=default,
                                         help=help_of(item) + (note if own else "")), config_class, item, own)
            continue
        _declare(parser.add_argument(flag_of(item), type=parser_of(item), choices=spec["choices"], default=default,
                                     help=help_of(item) + note, metavar=_metavar(item, spec)), config_class, item, own)


def validate_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: Sequence[str] = ()) -> None:
    """Check the values of the options :func:`add_flags` declared on ``parser`` as the trainer does:
    each config class is built from them (the rest of its fields at their defaults), so a value the
    trainer refuses (``--micro-batch-size 0``, an unknown ``--preset``) is one :class:`UserError`
    with the trainer's message here too. ``skip``: flags the entry point checks itself (a value of
    its own beyond the schema's, such as ``--preset auto``)."""
    values: Dict[type, Dict[str, Any]] = {}
    for action in parser._actions:
        declared = getattr(action, "declared", None)
        if declared is None or action.default is argparse.SUPPRESS or set(action.option_strings) & set(skip):
            continue
        values.setdefault(declared.config_class, {})[declared.field] = getattr(args, action.dest)
    for config_class, given in values.items():
        config_class(**given)


def _metavar(item, spec):
    if spec["choices"]:
        return "{" + ",".join(map(str, spec["choices"])) + "}"
    return item.name.upper()


def values_for(namespace: argparse.Namespace, section: str, config_class) -> Dict[str, Any]:
    """The fields of ``config_class`` that ``namespace`` sets, as constructor keyword args."""
    given = vars(namespace)
    return {item.name: given[_dest(section, item)] for item, _ in options_of(config_class)
            if _dest(section, item) in given}


def yaml_value(item: dataclasses.Field, value: Any) -> Any:
    """A YAML value for an option field, converted as its flag would be. Raises ValueError
    (or the option's own parser's error) with a short reason for a value of the wrong kind."""
    spec = item.metadata[_KEY]
    kind = _base_type(item.type)
    if value is None:
        if _default_of(item) is None:
            return None
        raise ValueError("must not be empty")
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return (not value) if spec["negative"] else value
    if isinstance(value, bool):
        raise ValueError("must not be a boolean")
    if spec["parse"] is not None:
        result = spec["parse"](value)
    elif kind is float and isinstance(value, (int, float)):
        result = finite_float(value)
    elif kind is int and isinstance(value, int):
        result = value
    elif kind is str and isinstance(value, (str, int, float)):
        result = str(value)
    elif isinstance(value, str):
        result = parser_of(item)(value)
    else:
        raise ValueError(f"must be of type {getattr(kind, '__name__', kind)}")
    if spec["choices"] and result not in spec["choices"]:
        raise ValueError(f"must be one of {', '.join(map(str, spec['choices']))}")
    return result


def json_object_text(value) -> str:
    """An options flag's value: a JSON object (text on the command line, a mapping or text in YAML),
    kept as canonical JSON text so the config stays hashable ('' for none)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadValue("must be a JSON object, e.g. '{\"scale\": 0.5}'") from None
    if not isinstance(value, dict):
        raise BadValue(f"must be a JSON object of options, not {type(value).__name__}")
    return json.dumps(value, sort_keys=True) if value else ""


json_object_text.__name__ = "JSON object"  # argparse: "invalid JSON object value: 'abc'"
