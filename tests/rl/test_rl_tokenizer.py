"""Tokenizer round trips for SentencePiece and HF tokenizer.json, the factory's errors, and the
embedded default tokenizer's training and caching. Everything is built locally, no downloads."""

import json

import pytest

from logra_megatron import tokenizer as tokenizer_module
from logra_megatron.errors import UserError
from logra_megatron.rl.tasks import ArithmeticTaskConfig, ArithmeticTasks, tokenizer_corpus
from logra_megatron.tokenizer import (
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    default_task_tokenizer,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "Calculate 5 - 3 - 6. The answer is -4.",
] * 20
SAMPLES = ["The lazy fox sold 48 clips.", "12+7=19", "  two  spaces and\ttab", "Answer: -4"]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import sentencepiece

    prefix = tmp_path_factory.mktemp("sp") / "bpe"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(prefix), model_type="bpe", vocab_size=120,
        byte_fallback=False, character_coverage=1.0, minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# --- SentencePiece -----------------------------------------------------------------------------

def test_sentencepiece_round_trip(sentencepiece_model):
    tok = build_tokenizer("SentencePieceTokenizer", sentencepiece_model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 120
    for text in ["The lazy fox sold 48 clips.", "Calculate 5 - 3 - 6."]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Specials: SentencePiece's defaults (unk 0, bos 1, eos 2, no pad -> eos). encode adds none.
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.bos_id not in tok.encode("The fox") and tok.eos_id not in tok.encode("The fox")
    assert tok.decode([tok.bos_id, *tok.encode("The fox"), tok.eos_id]) == "The fox"


def test_megatron_aliases_give_sentencepiece(sentencepiece_model):
    for alias in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        assert isinstance(build_tokenizer(alias, sentencepiece_model), SentencePieceTokenizer)


# --- Hugging Face tokenizer.json ---------------------------------------------------------------

def test_huggingface_round_trip_with_spelling_fallback(hf_folder):
    tok = build_tokenizer("HuggingFaceTokenizer", hf_folder / "tokenizer.json")
    assert isinstance(tok, HuggingFaceTokenizer)
    vocab = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.vocab_size == max(vocab.values()) + 1 == len(vocab)  # training stopped below 400
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text  # byte-level BPE is lossless
    # No tokenizer_config.json: recognized spellings.
    assert tok.eos_id == 0  # <|endoftext|>, the first special token
    assert tok.bos_id is None  # none of the usual BOS spellings is in this vocabulary
    assert tok.pad_id == 3  # <pad>
    assert tok.decode([*tok.encode("12+7="), tok.eos_id, tok.pad_id]) == "12+7="
    assert tok.encode("<|im_end|>") == [2]  # special tokens in text still map to their id


def test_huggingface_folder_and_declared_special_tokens(hf_folder, tmp_path):
    (tmp_path / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": "<|im_start|>",
        "pad_token": None,
    }))
    tok = build_tokenizer("HuggingFaceTokenizer", tmp_path)  # a folder works too
    assert (tok.eos_id, tok.bos_id) == (2, 1)
    assert tok.pad_id == 3  # pad_token None: the usual spelling is still found


def test_huggingface_without_any_eos_is_a_user_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="end-of-sequence"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path / "tokenizer.json")


# --- factory errors ----------------------------------------------------------------------------

def test_factory_errors(tmp_path, sentencepiece_model):
    with pytest.raises(UserError, match="unknown tokenizer type 'GPT2BPETokenizer'") as error:
        build_tokenizer("GPT2BPETokenizer", sentencepiece_model)
    assert "HuggingFaceTokenizer" in str(error.value)
    with pytest.raises(UserError, match="does not exist"):
        build_tokenizer("SentencePieceTokenizer", tmp_path / "missing.model")
    with pytest.raises(UserError, match="does not exist"):
        build_tokenizer("HuggingFaceTokenizer", None)
    with pytest.raises(UserError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path)
    with pytest.raises(UserError, match="folder"):
        build_tokenizer("SentencePieceTokenizer", tmp_path)
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a sentencepiece model")
    with pytest.raises(UserError, match="cannot read SentencePiece"):
        build_tokenizer("SentencePieceTokenizer", corrupt)
    bad_json = tmp_path / "bad" / "tokenizer.json"
    bad_json.parent.mkdir()
    bad_json.write_text("{not json")
    with pytest.raises(UserError, match="cannot read Hugging Face"):
        build_tokenizer("HuggingFaceTokenizer", bad_json)


# --- the embedded default ----------------------------------------------------------------------

def test_default_tokenizer_fits_tiny_and_splits_digits(tmp_path):
    tok = default_task_tokenizer(tmp_path, tokenizer_corpus())
    assert tok.vocab_size <= 256
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    for digit in "0123456789":
        assert len(tok.encode(digit)) == 1
    assert [tok.id_to_piece(i) for i in tok.encode("12+7=")] == ["1", "2", "+", "7", "="]
    for record in ArithmeticTasks().train_prompts(50):
        text = record["prompt"] + record["answer"]
        ids = tok.encode(text)
        assert len(ids) == len(text) and tok.decode(ids) == text
        assert tok.decode(tok.encode(record["answer"])) == record["answer"]
    for text in ["Calculate 5 - 3 - 6.", "  spaces  kept ", "#### 72 {x}"]:
        assert tok.decode(tok.encode(text)) == text  # any printable ASCII round-trips


def test_default_tokenizer_is_cached_by_settings(tmp_path, monkeypatch):
    first = default_task_tokenizer(tmp_path, tokenizer_corpus())
    files = sorted(tmp_path.glob("*.model"))
    assert len(files) == 1 and not list(tmp_path.glob(".*tmp"))
    modified = files[0].stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached model should have been reused")

    monkeypatch.setattr(tokenizer_module, "_train_default_model", no_training)
    again = default_task_tokenizer(tmp_path, tokenizer_corpus())
    assert files[0].stat().st_mtime_ns == modified
    assert again.encode("98-76=22") == first.encode("98-76=22")

    # Other training settings: another cache entry (training is needed, and was stubbed out).
    other_text = ArithmeticTasks(ArithmeticTaskConfig(operations=("*",))).text_samples(200)
    with pytest.raises(AssertionError, match="reused"):
        default_task_tokenizer(tmp_path, other_text)
    monkeypatch.undo()
    other = default_task_tokenizer(tmp_path, other_text)
    assert len(list(tmp_path.glob("*.model"))) == 2
    assert other.decode(other.encode("9*9=81")) == "9*9=81"
