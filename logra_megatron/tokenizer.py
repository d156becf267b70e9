"""One tokenizer interface over SentencePiece ``.model`` files and Hugging Face ``tokenizer.json``.

The RL loop needs only a handful of operations: ``encode(text) -> ids``, ``decode(ids) ->
text``, the vocabulary size (to check it fits the model's embedding) and the ids of the end of
sequence, padding and beginning of sequence tokens. :class:`Tokenizer` is that interface;
:func:`build_tokenizer` picks the implementation from Megatron-style type names
(``SentencePieceTokenizer``, ``HuggingFaceTokenizer``), so a ``--tokenizer-type`` /
``--tokenizer-model`` pair from a Megatron command line works unchanged.

Conventions, the same for both implementations:

- ``encode`` adds no special tokens (no BOS, no EOS): the caller decides where they go (a
  prompt usually starts with ``bos_id`` when the tokenizer has one; a completion ends at
  ``eos_id``). ``decode`` drops special tokens.
- ``bos_id`` is ``None`` when the tokenizer has no BOS token. ``pad_id`` falls back to
  ``eos_id`` when the tokenizer defines no padding token (padding positions are always masked,
  so any valid id works).
- HF: the special tokens are read from ``tokenizer_config.json`` / ``special_tokens_map.json``
  next to ``tokenizer.json`` when present, else recognized by their usual spellings.

The embedded default (:func:`default_task_tokenizer`) is a character-level SentencePiece model
trained at first use on text of the arithmetic task plus every printable ASCII character, so
every digit is its own token (arithmetic is learnable digit by digit) and any ASCII prompt can be
encoded; about 100 pieces, within the ``tiny`` preset's vocabulary of 256. It is trained in well
under a second and cached under a file name that hashes the training settings, so every later run
with the same settings loads the same ids. The file is written to a temporary name and renamed,
so ranks that race to create it each see either no file or a complete one.
"""

import hashlib
import io
import json
import os
import string
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional

from logra_megatron.errors import UserError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGINGFACE_TYPES = ("HuggingFaceTokenizer",)


class Tokenizer(ABC):
    """Text <-> token ids, plus the special ids the RL loop needs."""

    @abstractmethod
    def encode(self, text: str) -> list:
        """Token ids of ``text``, without special tokens."""

    @abstractmethod
    def decode(self, ids) -> str:
        """Text of ``ids``, special tokens dropped."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (the model's vocabulary must be at least this)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id: generation stops here."""

    @property
    @abstractmethod
    def bos_id(self) -> Optional[int]:
        """Beginning-of-sequence id, or None if the tokenizer has none."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Padding id (``eos_id`` when the tokenizer defines no padding token)."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file."""

    def __init__(self, model_path):
        import sentencepiece

        self.model_path = str(model_path)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=self.model_path)
        if self._processor.eos_id() < 0:
            raise UserError(f"SentencePiece model {self.model_path} defines no end-of-sequence token")

    def encode(self, text: str) -> list:
        return list(self._processor.encode(text))

    def decode(self, ids) -> str:
        return self._processor.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def bos_id(self) -> Optional[int]:
        bos = self._processor.bos_id()
        return bos if bos >= 0 else None

    @property
    def pad_id(self) -> int:
        pad = self._processor.pad_id()
        return pad if pad >= 0 else self.eos_id

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(int(token_id))


_EOS_SPELLINGS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
_BOS_SPELLINGS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_PAD_SPELLINGS = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def _token_content(value) -> Optional[str]:
    """A special-token entry of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (a file, or a folder that holds one), read with the
    ``tokenizers`` package (no ``transformers`` needed)."""

    def __init__(self, path):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(path)
        self.tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        if not self.tokenizer_file.is_file():
            # Megatron-LM's HuggingFaceTokenizer goes through transformers' AutoTokenizer, which
            # also reads a slow tokenizer's files; here the fast tokenizer's tokenizer.json is read.
            slow = sorted(name for name in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
                          if path.is_dir() and (path / name).is_file())
            hint = (f" (it has {', '.join(slow)}: write tokenizer.json once with transformers: "
                    f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))") if slow else ""
            raise UserError(f"no tokenizer.json at {path}{hint}")
        try:
            self._tokenizer = FastTokenizer.from_file(str(self.tokenizer_file))
        except Exception as error:  # the tokenizers package raises a bare Exception
            raise UserError(f"cannot read Hugging Face tokenizer {self.tokenizer_file}: {error}") from None
        declared = self._declared_special_tokens(self.tokenizer_file.parent)
        self._eos_id = self._special_id(declared.get("eos_token"), _EOS_SPELLINGS)
        self._bos_id = self._special_id(declared.get("bos_token"), _BOS_SPELLINGS)
        self._pad_id = self._special_id(declared.get("pad_token"), _PAD_SPELLINGS)
        if self._eos_id is None:
            raise UserError(
                f"cannot tell the end-of-sequence token of {self.tokenizer_file}: add eos_token to "
                f"a tokenizer_config.json next to it"
            )

    @staticmethod
    def _declared_special_tokens(folder: Path) -> dict:
        declared = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            file = folder / name
            if file.is_file():
                content = json.loads(file.read_text())
                for key in ("eos_token", "bos_token", "pad_token"):
                    token = _token_content(content.get(key))
                    if token is not None:
                        declared[key] = token
        return declared

    def _special_id(self, declared: Optional[str], spellings) -> Optional[int]:
        for token in ([declared] if declared else []) + list(spellings):
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
            if token == declared:
                break  # a declared token that is not in the vocabulary: do not guess
        return None

    def encode(self, text: str) -> list:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id if self._pad_id is not None else self._eos_id


def build_tokenizer(tokenizer_type: str, tokenizer_model) -> Tokenizer:
    """The tokenizer named by a Megatron-style type and its model file.

    ``SentencePieceTokenizer`` (aliases ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``)
    takes a ``.model`` file; ``HuggingFaceTokenizer`` (Megatron-LM's name) takes a ``tokenizer.json`` or a local folder
    holding one.
    """
    known = SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES
    if tokenizer_type not in known:
        raise UserError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(known)}")
    if tokenizer_model is None or not Path(tokenizer_model).exists():
        raise UserError(f"tokenizer model {tokenizer_model} (for {tokenizer_type}) does not exist")
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if not Path(tokenizer_model).is_file():
            raise UserError(f"{tokenizer_type} needs a SentencePiece .model file, got folder {tokenizer_model}")
        try:
            return SentencePieceTokenizer(tokenizer_model)
        except (RuntimeError, OSError) as error:
            raise UserError(f"cannot read SentencePiece model {tokenizer_model}: {error}") from None
    return HuggingFaceTokenizer(tokenizer_model)


# --- the embedded default ----------------------------------------------------------------------

def _default_training_settings(texts) -> dict:
    import sentencepiece  # optional at import time: only the embedded default needs it

    return {
        "text_sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
        "extra_characters": string.printable,
        "model_type": "char",
        "special_ids": {"pad": 0, "unk": 1, "bos": 2, "eos": 3},
        "sentencepiece": sentencepiece.__version__,
        "format": 3,
    }


def _train_default_model(settings: dict, texts) -> bytes:
    import sentencepiece  # optional at import time: only the embedded default needs it

    lines = list(texts)
    # One line of every printable ASCII character (space included) so each gets a piece.
    lines.append("".join(ch for ch in settings["extra_characters"] if ch.isprintable()))
    model = io.BytesIO()
    ids = settings["special_ids"]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type=settings["model_type"],
        vocab_size=256,  # an upper bound: a character model keeps only the characters it saw
        hard_vocab_limit=False,
        character_coverage=1.0,
        add_dummy_prefix=False,  # "12+7=" encodes to exactly its 5 characters
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",  # no NFKC rewriting: decode(encode(s)) == s
        pad_id=ids["pad"], unk_id=ids["unk"], bos_id=ids["bos"], eos_id=ids["eos"],
        minloglevel=2,
    )
    return model.getvalue()


def default_task_tokenizer(cache_dir, texts) -> SentencePieceTokenizer:
    """The embedded default tokenizer: a character-level SentencePiece model trained on
    ``texts`` (lines of task text; the trainer passes ``rl.tasks.tokenizer_corpus()``) plus every
    printable ASCII character, on first use, and cached in ``cache_dir`` under a hash of the
    text and the settings. Character ids are ordered by frequency in ``texts``."""
    texts = list(texts)
    settings = _default_training_settings(texts)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    path = cache_dir / f"task_tokenizer_{key}.model"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        model_bytes = _train_default_model(settings, texts)
        handle, temporary = tempfile.mkstemp(dir=cache_dir, prefix=".task_tokenizer_", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(model_bytes)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
    return SentencePieceTokenizer(path)
