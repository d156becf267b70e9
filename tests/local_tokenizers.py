"""Tokenizer folders the tests build on the spot (nothing is downloaded)."""

import json
import string


def hf_tokenizer_folder(directory, vocab_size=120):
    """A local tokenizer folder as save_pretrained leaves it: tokenizer.json (a character BPE over
    printable ASCII, trained here) and tokenizer_config.json naming its end-of-sequence token."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # pieces joined as they are (no spaces between them)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<unk>", "<pad>"],
                                  initial_alphabet=list(string.printable))
    tokenizer.train_from_iterator([f"{a}+{b}={a + b}" for a in range(150) for b in range(0, 150, 7)], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory
