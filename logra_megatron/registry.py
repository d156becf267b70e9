"""One plug-in mechanism: a registry of named entries that also takes outside code.

Tasks, rewards, LoGRA update rules, rollout engines and attention backends each keep one
:class:`Registry`. A flag's value is a registered name, or ``package.module:attr`` for code outside
the package (slime's ``--custom-rm-path`` is the model); each entry brings its one-line help (the
flag's help is generated from the registry) and may bring its own options dataclass. A bad value
is one :class:`~logra_megatron.errors.UserError` line.
"""

import dataclasses
import difflib
import importlib
import re
from typing import Any, Callable, Dict, Optional

from logra_megatron.schema import BadValue

PLUGIN_PATH_FORM = "package.module:attr"
"""How a flag names outside code (slime's ``--custom-rm-path``, ``--custom-generate-function-path``):
the module is imported (it must be on ``sys.path``, e.g. through ``PYTHONPATH``) and the attribute
(dotted for a nested one) is the entry."""

_PLUGIN_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


@dataclasses.dataclass
class Entry:
    """One plug-in: what ``name`` (a registered name or a ``package.module:attr`` path) resolves to.

    ``target`` is the object, or ``"module:attr"`` text imported on first use (so a registry can
    list entries whose modules need torch or vLLM without importing them). ``help`` is the
    one-line description the flag's help is generated from; ``options`` the entry's own options
    dataclass (None when it takes none); ``info`` whatever else the kind records (a reward's
    ``needs``)."""

    name: str
    target: Any
    help: str = ""
    options: Optional[type] = None
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)
    listed: bool = True
    """Shown by name in the help (False for families summarized there, e.g. reasoning-gym datasets)."""
    outside: bool = False
    """Named by ``package.module:attr`` (loaded from outside the registry)."""


class Registry:
    """The plug-ins of one kind (tasks, rewards, update rules, ...) by name, and outside code by
    ``package.module:attr``.

    ``kind`` names the kind in messages (``"reward"``), ``flag`` the flag that picks one
    (``"--reward"``). ``accepts(obj)`` returns why an object is not of this kind (None when it is);
    it is asked of every outside object and every lazily imported one. ``adapt(obj)`` turns an
    outside object into what registered entries are (rewards wrap theirs to return floats).
    ``summary`` (optional) describes, after the listed names, the entries registered with
    ``listed=False`` (a family such as the reasoning-gym datasets). ``prefixes``: names
    that take an argument after them (``"jsonl:"`` for ``jsonl:PATH``), looked up before a path.

    A bad value is one :class:`~logra_megatron.errors.UserError` line: an unknown name (with close
    matches), a path whose module does not import, an attribute that is missing, an object that is
    not of this kind. Only the standard library is used, so the registry sits at the bottom of the
    package and a kind can declare its entries by path without importing them.
    """

    def __init__(self, kind: str, flag: str, *, accepts: Optional[Callable[[Any], Optional[str]]] = None,
                 adapt: Optional[Callable[[Any], Any]] = None, summary: Optional[str] = None,
                 close_cutoff: float = 0.6):
        self.kind, self.flag = kind, flag
        self._accepts, self._adapt, self._summary, self._cutoff = accepts, adapt, summary, close_cutoff
        self._entries: Dict[str, Entry] = {}
        self._prefixes: Dict[str, Entry] = {}
        self._outside: Dict[str, Entry] = {}

    # registration
    def register(self, name: str, target: Any = None, *, help: str = "", options: Optional[type] = None,
                 listed: bool = True, prefix: bool = False, **info):
        """Register ``target`` (an object or ``"module:attr"`` text) under ``name``; without
        ``target``, a decorator. ``prefix=True``: ``name`` is a prefix taking an argument
        (``"jsonl:"``). A name registered twice is a ``ValueError`` (a programming error)."""

        def add(obj):
            table = self._prefixes if prefix else self._entries
            if name in table:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            table[name] = Entry(name, obj, help or _first_line(obj), options or _options_of(obj), dict(info), listed)
            return obj

        return add if target is None else add(target)

    # lookup
    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __getitem__(self, name: str):
        return self.get(name)

    def declared(self, name: str) -> Optional[Entry]:
        """The registered entry ``name`` as declared (a lazy target not imported), or None."""
        return self._entries.get(name)

    def values(self) -> list:
        """Every registered entry's object (lazy ones imported)."""
        return [self.get(name) for name in self._entries]

    @staticmethod
    def is_path(value) -> bool:
        """Whether ``value`` has the ``package.module:attr`` form."""
        return isinstance(value, str) and bool(_PLUGIN_PATH.match(value))

    def prefix_of(self, value: str) -> Optional[str]:
        """The registered prefix ``value`` starts with (``"jsonl:"``), or None."""
        return next((prefix for prefix in self._prefixes if isinstance(value, str) and value.startswith(prefix)), None)

    def entry(self, value: str) -> Entry:
        """The entry ``value`` names, its target imported and checked; a one-line ``UserError`` if none."""
        from logra_megatron.errors import UserError

        if not isinstance(value, str) or not value:
            raise UserError(f"{self.flag} needs a {self.kind}: {self.choices_text()}")
        if value in self._entries:
            entry = self._entries[value]
        elif self.prefix_of(value) is not None:
            return self._prefixes[self.prefix_of(value)]
        elif self.is_path(value):
            if value not in self._outside:
                obj = self._import(value)
                self._outside[value] = Entry(value, self._adapt(obj) if self._adapt else obj, _first_line(obj),
                                             _options_of(obj), {"source": obj}, False, True)
            return self._outside[value]
        else:
            raise UserError(self.unknown(value))
        if isinstance(entry.target, str) and self.is_path(entry.target):
            entry.target = self._import(entry.target, name=value)
            entry.options = entry.options or _options_of(entry.target)
        return entry

    def get(self, value: str):
        """The object ``value`` names (see :meth:`entry`)."""
        return self.entry(value).target

    def check(self, value: str) -> str:
        """``value`` when it names an entry (an outside one imported and checked), else the
        ``UserError``. Registered entries declared by path are not imported here."""
        if value in self._entries or (isinstance(value, str) and self.prefix_of(value) is not None):
            return value
        self.entry(value)
        return value

    def parse(self, value) -> str:
        """``check`` as an option's ``parse=``: argparse and the YAML reader report the error on the flag."""
        from logra_megatron.errors import UserError, one_line

        try:
            return self.check(value)
        except UserError as error:
            message = one_line(error)
            raise BadValue(message[len(self.flag) + 1:] if message.startswith(self.flag + " ") else message) from None

    def options_for(self, value: str, given: Dict[str, Any], flag: str):
        """The entry's options dataclass built from ``given`` (a mapping, e.g. a JSON object of a
        flag), or None when the entry declares none; a ``UserError`` for a key it does not have."""
        from logra_megatron.errors import UserError

        entry = self.entry(value)
        if entry.options is None:
            if given:
                raise UserError(f"{flag}: {self.flag} {value} takes no options")
            return None
        known = [item.name for item in dataclasses.fields(entry.options)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise UserError(f"{flag}: {self.flag} {value} has no option {', '.join(unknown)} "
                            f"(its options: {', '.join(known) or 'none'})")
        try:
            return entry.options(**given)
        except (TypeError, ValueError) as error:
            raise UserError(f"{flag}: {self.flag} {value}: {error}") from None

    # messages and help
    def choices_text(self) -> str:
        """The names for a message or the help: the summary, or the listed names."""
        listed = ", ".join(self.names(listed_only=True)) + (f", {self._summary}" if self._summary else "")
        return f"{listed}, or {PLUGIN_PATH_FORM} for outside code"

    def _rows(self) -> list:
        """``(shown name, entry)`` of every registered entry, prefixes as ``jsonl:PATH``."""
        return list(self._entries.items()) + [(entry.info.get("shown", name + "ARG"), entry)
                                              for name, entry in self._prefixes.items()]

    def names(self, listed_only: bool = False) -> tuple:
        """Registered names in registration order (a prefix shown with its argument: ``jsonl:PATH``)."""
        return tuple(name for name, entry in self._rows() if entry.listed or not listed_only)

    def help(self, lead: str) -> str:
        """A flag's help generated from the entries: ``lead: name (its help), ...``."""
        parts = [f"{name} ({entry.help})" if entry.help else name for name, entry in self._rows() if entry.listed]
        extra = f", {self._summary}" if self._summary else ""
        return f"{lead}: {', '.join(parts)}{extra}; or {PLUGIN_PATH_FORM} (outside code, imported from PYTHONPATH)"

    def unknown(self, value: str) -> str:
        close = difflib.get_close_matches(value, self.names(), n=5, cutoff=self._cutoff)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        return f"unknown {self.kind} {value!r} ({self.flag}); {hint}known: {self.choices_text()}"

    def _import(self, path: str, name: Optional[str] = None):
        from logra_megatron.errors import UserError

        shown = f"{self.flag} {name or path}"
        module_name, attr = path.split(":", 1)
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
                raise UserError(f"{shown}: no module named {error.name!r} (is its directory on PYTHONPATH?)") from None
            raise UserError(f"{shown}: importing {module_name} failed: {type(error).__name__}: {error}") from None
        except Exception as error:  # the outside module's own failure, reported on the flag
            raise UserError(f"{shown}: importing {module_name} failed: {type(error).__name__}: {error}") from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise UserError(f"{shown}: {module_name} has no attribute {attr!r}")
            obj = getattr(obj, part)
        reason = self._accepts(obj) if self._accepts else None
        if reason:
            article = "an" if self.kind[:1] in "aeiou" else "a"
            raise UserError(f"{shown}: {attr} is not {article} {self.kind}: {reason}")
        return obj


def _options_of(obj) -> Optional[type]:
    """An entry's own options: the dataclass its ``options`` attribute names, else None."""
    options = None if isinstance(obj, str) else getattr(obj, "options", None)
    return options if isinstance(options, type) and dataclasses.is_dataclass(options) else None


def _first_line(obj) -> str:
    doc = getattr(obj, "__doc__", None) if not isinstance(obj, str) else None
    return doc.strip().splitlines()[0].rstrip(".") if doc and doc.strip() else ""
