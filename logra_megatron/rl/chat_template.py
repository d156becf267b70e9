"""A Hugging Face tokenizer's chat template, found next to its ``tokenizer.json`` and rendered
as transformers' ``apply_chat_template(..., tokenize=False)`` renders it.

Where the template comes from (the order transformers loads them in): a ``chat_template.jinja``
file (what transformers 5 saves) wins over the ``chat_template`` entry of
``tokenizer_config.json``, which is a string, or a list of ``{"name", "template"}`` of which the
one named ``default`` is used. The named special tokens of ``tokenizer_config.json`` (over
``special_tokens_map.json``) are template variables, as in transformers: ``bos_token``,
``eos_token``, ``unk_token``, ``pad_token``, ...

How it is rendered (what makes a template's output the same as transformers'):

- jinja2's *immutable sandboxed* environment (a template is untrusted code from a model
  repository: no attribute access to Python internals, no mutation of lists and dicts passed in),
  with ``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols`` extension;
- a ``{% generation %}...{% endgeneration %}`` block renders its body (transformers uses it to
  mark assistant tokens; the text is unchanged);
- ``raise_exception(message)`` (a template's own error: a :class:`UserError` here),
  ``strftime_now(format)``, a ``tojson`` filter that does not escape HTML and keeps non-ASCII
  text, ``dict(...)`` and a ``namespace`` that refuses underscore names;
- the variables ``messages`` (None-valued keys of a message dropped), ``tools=None``,
  ``documents=None``, ``add_generation_prompt`` and the special tokens.

jinja2 (>= 3.1.6, older versions have known sandbox escapes) is imported when a template is
compiled: it comes with transformers; the trainer needs it only with a chat template.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from logra_megatron.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers passes to a template (``special_tokens_map``)."""
MIN_JINJA = (3, 1, 6)


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Optional[dict] = None, origin: str = "chat template"):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        self._template = _compile(source, origin)

    def render(self, messages: list, add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as text; ``variables`` override the special tokens (as transformers'
        keyword arguments do)."""
        import jinja2

        messages = [{key: value for key, value in dict(message).items() if value is not None} for message in messages]
        context = {**self.special_tokens, **variables}
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as error:  # raise_exception, undefined operations, sandbox refusals
            raise UserError(f"the {self.origin} refused the conversation: {error}") from None


def find_chat_template(folder) -> Optional[ChatTemplate]:
    """The chat template of the tokenizer in ``folder`` (module docstring), or None."""
    folder = Path(folder)
    config = _read_json(folder / TOKENIZER_CONFIG)
    special = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # the latter wins
        content = config if name == TOKENIZER_CONFIG else _read_json(folder / name)
        for key in SPECIAL_TOKEN_NAMES:
            token = _token_text(content.get(key))
            if token is not None:
                special[key] = token
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"cannot read the chat template {jinja_file}: {error}") from None
        return ChatTemplate(source, special, origin=f"chat template {jinja_file}")
    source = _template_from_config(config.get("chat_template"), folder / TOKENIZER_CONFIG)
    if source is None:
        return None
    return ChatTemplate(source, special, origin=f"chat template of {folder / TOKENIZER_CONFIG}")


def chat_template_of(tokenizer) -> Optional[ChatTemplate]:
    """The chat template of a run's tokenizer (``logra_megatron.tokenizer``): a Hugging Face
    tokenizer's, or None (SentencePiece models and the embedded default have none)."""
    tokenizer_file = getattr(tokenizer, "tokenizer_file", None)
    return None if tokenizer_file is None else find_chat_template(Path(tokenizer_file).parent)


# --- reading -----------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {str(error).splitlines()[0]}") from None
    return content if isinstance(content, dict) else {}


def _token_text(value) -> Optional[str]:
    """A special-token entry: a string or ``{"content": ...}`` (an AddedToken as saved)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(value, path: Path) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise UserError(f"{path} holds several chat templates ({', '.join(map(str, named))}) and none named "
                        f"'default'")
    raise UserError(f"{path}: chat_template must be a string or a list of named templates")


# --- the environment ---------------------------------------------------------------------------

def _compile(source: str, origin: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA:
        raise UserError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes); "
                        f"found {jinja2.__version__}: pip install -U jinja2")

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}`` renders ``body`` (transformers marks the
        assistant's tokens with it; the text is the same)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's ``namespace()``, refusing attribute names that start with ``_``."""

        def __init__(*args, **kwargs):
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                _public_name(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            _public_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _public_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class DictMaker:
        """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the ``dict`` type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                               dict=DictMaker(), namespace=Namespace)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(f"the {origin} is not a valid Jinja template: {error.message} (line {error.lineno})") from None
