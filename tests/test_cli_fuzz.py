"""Fuzzing the trainer's command line and config files: every malformed input ends with exactly
one ``error:`` line on stderr and exit code 2, never a traceback, and never starts training.

The cases are generated (seeded, so the same on every run) from the config schema itself: every
flag of ``python -m logra_megatron.train`` gets values of the wrong type, negative, zero or
non-finite numbers, and a YAML key of the wrong kind, so a new option is fuzzed as soon as it is
declared. Hand-written cases add what the schema cannot tell: unknown flags and keys, YAML of the
wrong shape or encoding, missing or wrong-kind paths, impossible layouts and contradictory
combinations.

Most cases run in-process through ``logra_megatron.train.main`` (the function the entry point
runs) with the trainer stubbed out: a case that validates would reach the stub, which fails the
test instead of training. A few run as real ``python -m logra_megatron.train`` subprocesses.
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
import types
import typing
from typing import Dict, List, Optional, Tuple, Union

import pytest
import yaml
from dist_harness import REPO

import logra_megatron
import logra_megatron.rl
from logra_megatron import schema
from logra_megatron.config import SECTIONS, _section_class, build_parser
from logra_megatron.rl.config import TrainConfig

SEED = 20240611
DIR = object()
"""A ``files`` value: make a directory there instead of a file."""


@dataclasses.dataclass
class Case:
    id: str
    category: str
    argv: List[str]
    files: Dict[str, object] = dataclasses.field(default_factory=dict)
    """Relative path -> str or bytes content (or DIR), made under the test's tmp dir; ``{tmp}``
    in argv and in str contents is replaced by that dir."""
    world_size: Union[int, str] = 1
    """WORLD_SIZE, as torchrun would set it."""
    needle: Optional[str] = None
    """Text the error line must contain (case-insensitive; ``_`` and ``-`` count as equal): the
    option or file the message has to name."""


# --- the options, from the schema --------------------------------------------------------------

@dataclasses.dataclass
class Option:
    section: str
    name: str
    flag: str
    kind: str  # bool, choice, custom, int, float, str
    choices: Tuple = ()

    @property
    def key(self) -> str:
        return self.flag.lstrip("-")


def _base(annotation):
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is Union and len(args) == 1:
        return args[0]
    return annotation


def schema_options() -> List[Option]:
    sections = {item.name: item.type for item in dataclasses.fields(TrainConfig)}
    found = []
    for section, _ in SECTIONS:
        for item, spec in schema.options_of(sections[section]):
            base = _base(item.type)
            if base is bool:
                kind = "bool"
            elif spec["choices"]:
                kind = "choice"
            elif spec["parse"] is not None:
                kind = "custom"
            elif base in (int, float, str):
                kind = base.__name__
            else:
                raise AssertionError(f"the fuzzer does not know option {item.name} of type {item.type}")
            found.append(Option(section, item.name, schema.flag_of(item), kind, tuple(spec["choices"] or ())))
    return found


OPTIONS = schema_options()
BY_FLAG = {option.flag: option for option in OPTIONS}

NEGATIVE_ALLOWED = {"--entropy-coef"}
"""Numeric options for which -1 is a valid value (an entropy penalty instead of a bonus)."""
ZERO_INVALID = ("--micro-batch-size", "--prompts-per-step", "--group-size",
                "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--max-new-tokens",
                "--eval-prompts", "--log-interval", "--kl-probe-sequences", "--logra-refresh-interval",
                "--max-operand", "--logra-rank", "--kl-target", "--adam-eps", "--top-p",
                "--held-out-fraction", "--temperature", "--kl-max-scale")
"""Sizes and rates for which 0 is not a value (``--train-iters 0`` is: the warm-up alone)."""
PATH_OPTIONS = ("--tokenizer-model", "--load", "--save", "--output-dir", "--tensorboard-dir")
"""Free-text options that name a path (fuzzed in the path cases, not with random text)."""
FREE_TEXT_OPTIONS = {"--preset": "an unknown preset", "--reward": "an unknown reward"}
"""Free-text options with a closed set of valid values (checked in __post_init__)."""

BAD_INT = ("abc", "1.5", "2e3", "0x10", "", "seven", "7.0", "1/2", "3,5", "True")
BAD_FLOAT = ("abc", "1.2.3", "", "1e", "one", "1,5", "0x1p3", "nana", "5%", "False")
BAD_RANK = ("abc", "1/2", "", "half", "0.5.0", "r16")
NON_FINITE = ("nan", "inf", "NaN", "Infinity", "1e999")
WORDS = ("nope", "banana", "ADAM", "Logra", "none ", "default", "auto", "42")


# --- case generation ---------------------------------------------------------------------------

def _typo(rng: random.Random, flag: str, known: set) -> str:
    """A misspelling of a real flag that is no real flag."""
    body = flag[2:]
    for _ in range(100):
        how = rng.randrange(5)
        if how == 0 and len(body) > 2:  # drop a character
            i = rng.randrange(1, len(body) - 1)
            candidate = body[:i] + body[i + 1:]
        elif how == 1 and len(body) > 2:  # swap two neighbours
            i = rng.randrange(len(body) - 1)
            candidate = body[:i] + body[i + 1] + body[i] + body[i + 2:]
        elif how == 2:  # Python spelling
            candidate = body.replace("-", "_") if "-" in body else body + "_"
        elif how == 3:  # a plural / an extra letter
            candidate = body + rng.choice("sx")
        else:  # a prefix (argparse would otherwise accept abbreviations)
            candidate = body[:max(2, len(body) - rng.randrange(1, 4))]
        candidate = "--" + candidate
        if candidate not in known:
            return candidate
    raise AssertionError(f"no typo found for {flag}")


def _yaml_case(case_id: str, category: str, content, needle=None, argv=(), world_size=1, name="run.yaml"):
    return Case(case_id, category, ["--config", "{tmp}/" + name, *argv], {name: content},
                world_size=world_size, needle=needle)


def _wrong_yaml_values(rng: random.Random, option: Option) -> list:
    pools = {
        "int": [2.5, "abc", [1], {"a": 1}, True, "1e3"],
        "float": ["abc", [1.0], {"x": 1}, True, "1,5"],
        "bool": [3, "maybe", [True], 1.5, "on-ish"],
        "choice": [5, ["x"], {"a": 1}, "nope", True],
        "custom": ["abc", [1], True, {"r": 2}],
        "str": [[1], {"a": 1}, True],
    }
    return rng.sample(pools[option.kind], 1)


def generated_cases() -> List[Case]:
    rng = random.Random(SEED)
    cases: List[Case] = []
    known = set(BY_FLAG) | {"--config", "--help", "-h"}

    # 1. wrong types on the command line, every option of the schema.
    for option in OPTIONS:
        if option.kind == "int":
            cases.append(Case(f"type-{option.key}", "wrong type (flag)", [option.flag, rng.choice(BAD_INT)],
                              needle=option.flag))
        elif option.kind == "float":
            cases.append(Case(f"type-{option.key}", "wrong type (flag)", [option.flag, rng.choice(BAD_FLOAT)],
                              needle=option.flag))
        elif option.kind == "custom":
            cases.append(Case(f"type-{option.key}", "wrong type (flag)", [option.flag, rng.choice(BAD_RANK)],
                              needle=option.flag))
        elif option.kind == "choice":
            word = rng.choice([w for w in WORDS if w not in option.choices])
            cases.append(Case(f"choice-{option.key}", "wrong type (flag)", [option.flag, word], needle=option.flag))
        elif option.kind == "bool":
            cases.append(Case(f"switch-value-{option.key}", "wrong type (flag)",
                              [f"{option.flag}={rng.choice(['yes', '1', 'false', 'no'])}"], needle=option.flag))
        elif option.flag in FREE_TEXT_OPTIONS:
            cases.append(Case(f"value-{option.key}", "wrong type (flag)", [option.flag, rng.choice(WORDS[:3])],
                              needle=option.key))
        # other text options (paths, names) take any text: fuzzed in the path cases and in YAML

    # 2. negative, zero and non-finite numbers.
    for option in OPTIONS:
        if option.kind in ("int", "float", "custom") and option.flag not in NEGATIVE_ALLOWED:
            value = rng.choice(["-1", "-7", "-100"]) if option.kind != "float" else rng.choice(["-1", "-0.5", "-2.5"])
            cases.append(Case(f"negative-{option.key}", "negative / zero / non-finite number",
                              [option.flag, value], needle=option.key))
        if option.kind == "float":
            cases.append(Case(f"nonfinite-{option.key}", "negative / zero / non-finite number",
                              [option.flag, rng.choice(NON_FINITE)], needle=option.key))
    for flag in ZERO_INVALID:
        assert flag in BY_FLAG, f"{flag} is no longer an option: update ZERO_INVALID"
        cases.append(Case(f"zero-{flag[2:]}", "negative / zero / non-finite number",
                          [flag, rng.choice(["0", "0.0"]) if BY_FLAG[flag].kind == "float" else "0"],
                          needle=flag[2:]))
    cases.append(Case("huge-seed", "negative / zero / non-finite number", ["--seed", str(2**70)], needle="seed"))

    # 3. unknown flags, missing values, stray arguments.
    for flag in rng.sample(sorted(BY_FLAG), 10):
        typo = _typo(rng, flag, known)
        argv = [typo] if BY_FLAG[flag].kind == "bool" else [typo, "1"]
        cases.append(Case(f"unknown-{typo[2:]}", "unknown flag / missing value", argv, needle=typo))
    for argv, needle in (
            # Megatron flags the trainer does not take (a preset or --load decides the shape).
            (["--num-layers", "32"], "--num-layers"), (["--hidden-size", "8"], "--hidden-size"),
            (["--fp8-format"], "--fp8-format"), (["-x"], "-x"), (["run.yaml"], "run.yaml"), (["---lr", "1"], "---lr"),
            (["--micro", "4"], "--micro"), (["--no-prog"], "--no-prog"),
            (["--bogus\nflag"], "--bogus"), (["--lr", "1e-3", "extra", "args"], "extra")):
        cases.append(Case(f"unknown-{needle.strip('-')[:12]}", "unknown flag / missing value", argv, needle=needle))
    valued = [option.flag for option in OPTIONS if option.kind != "bool"]
    for flag in rng.sample(valued, 3) + ["--config"]:
        cases.append(Case(f"missing-value-{flag[2:]}", "unknown flag / missing value", ["--no-progress", flag],
                          needle=flag))

    # 4. YAML values of the wrong kind, every option of the schema (keys spelled either way).
    for option in OPTIONS:
        key = option.key if rng.random() < 0.5 else option.key.replace("-", "_")
        for value in _wrong_yaml_values(rng, option):
            cases.append(_yaml_case(f"yaml-type-{option.key}", "YAML: wrong type / empty value",
                                    yaml.safe_dump({key: value}), needle=option.key))
    for key in ("lr", "train-iters", "preset", "optimizer"):
        cases.append(_yaml_case(f"yaml-null-{key}", "YAML: wrong type / empty value", f"{key}:\n", needle=key))
    cases.append(_yaml_case("yaml-int-overflow", "YAML: wrong type / empty value", "lr: " + "9" * 400 + "\n",
                            needle="lr"))
    cases.append(_yaml_case("yaml-float-overflow", "YAML: wrong type / empty value", "kl-target: 1.0e+999\n",
                            needle="kl-target"))

    # 5. YAML keys nobody knows, at the top level and inside would-be sections.
    yaml_known = known | {"--" + option.key.replace("-", "_") for option in OPTIONS}
    for flag in rng.sample(sorted(BY_FLAG), 6):
        typo = _typo(rng, flag, yaml_known)[2:]
        cases.append(_yaml_case(f"yaml-unknown-{typo}", "YAML: unknown key", f"{typo}: 1\n", needle=typo))
    for name, text, needle in (
            ("section-model", "model:\n  preset: tiny\n", "model"), ("section-logra", "logra:\n  rank: 4\n", "logra"),
            ("section-run", "run:\n  seed: 3\n", "run"), ("config", "config: other.yaml\n", "config"),
            ("int", "1: 2\n", "1"), ("unhashable", "? [a, b]\n: 1\n", None), ("null", "null: 3\n", "None"),
            ("flag-as-section", "optimizer:\n  lr: 1.0e-3\n", "optimizer"),
            ("flag-as-section2", "kl-control:\n  target: 0.1\n", "kl-control"),
            ("duplicate", "lr: 1.0e-3\nlr: 2.0e-3\n", "lr"), ("duplicate-spellings", "top_k: 2\ntop-k: 3\n", "top")):
        cases.append(_yaml_case(f"yaml-key-{name}", "YAML: unknown key", text, needle=needle))

    # 6. YAML of the wrong shape.
    for name, text in (("list", "- lr: 1.0e-3\n- seed: 3\n"), ("empty-list", "[]\n"), ("int", "42\n"),
                       ("string", "just a string\n"), ("false", "false\n"), ("zero", "0\n"),
                       ("empty-string", "''\n"), ("set", "!!set {lr: null}\n"),
                       ("two-documents", "lr: 1.0e-3\n---\nseed: 3\n")):
        cases.append(_yaml_case(f"yaml-shape-{name}", "YAML: wrong shape", text, needle="run.yaml"))

    # 7. YAML that does not parse, or is not text.
    for name, text in (("unclosed-list", "lr: [1, 2\n"), ("indent", "lr: 1\n  seed: 2\n"),
                       ("unterminated-quote", "lr: 'unterminated\n"), ("tab", "\tlr: 1\n"),
                       ("unclosed-map", "lr: {a: 1\n"), ("no-key", ": 1\n"), ("undefined-alias", "lr: *undefined\n"),
                       ("python-tag", "!!python/object/apply:os.system ['true']\n"),
                       ("deep-nesting", "a: " + "[" * 2000 + "]" * 2000 + "\n"),
                       ("yaml-version", "%YAML 9.9\n---\nlr: 1\n"), ("int-5000-digits", "seed: " + "7" * 5000 + "\n")):
        cases.append(_yaml_case(f"yaml-syntax-{name}", "YAML: broken syntax", text, needle="run.yaml"))
    binary = bytes(rng.randrange(256) for _ in range(256))
    for name, content in (("empty", b""), ("blank", b"\n\n  \n"), ("comment-only", b"# only a comment\n"),
                          ("latin-1", b"lr: 1.0e-3 # caf\xe9\n"), ("utf-16-bom", b"\xff\xfe\x00l\x00r"),
                          ("random", binary), ("nul", b"lr: 1\x00\n"), ("utf-16-be", "lr: 0.001\n".encode("utf-16-be")),
                          ("bom-then-latin-1", b"\xef\xbb\xbfpreset: caf\xe9\n"), ("null-document", b"~\n")):
        cases.append(_yaml_case(f"yaml-bytes-{name}", "YAML: empty / binary / not UTF-8", content,
                                needle="run.yaml"))

    # 8. missing paths, and paths of the wrong kind.
    model_json = {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}

    def checkpoint(**changes):
        return {"ckpt/model_config.json": json.dumps({**model_json, **changes})}

    sentencepiece = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
    huggingface = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    load = ["--load", "{tmp}/ckpt"]
    for name, argv, files, needle in (
            ("config-missing", ["--config", "{tmp}/missing.yaml"], {}, "missing.yaml"),
            ("config-directory", ["--config", "{tmp}/folder"], {"folder": DIR}, "folder"),
            ("config-empty-path", ["--config", ""], {}, "--config"),
            ("config-newline-in-path", ["--config", "{tmp}/no\nwhere.yaml"], {}, "config"),
            ("load-missing", ["--load", "{tmp}/missing"], {}, "missing"),
            ("load-empty-path", ["--load", ""], {}, "load"),
            ("load-file", ["--load", "{tmp}/file"], {"file": "x"}, "file"),
            ("load-empty-directory", ["--load", "{tmp}/empty"], {"empty": DIR}, "model_config.json"),
            ("load-json-broken", load, {"ckpt/model_config.json": "{not json"}, "model_config.json"),
            ("load-json-list", load, {"ckpt/model_config.json": "[1, 2]"}, "model_config.json"),
            ("load-json-empty-object", load, {"ckpt/model_config.json": "{}"}, "model_config.json"),
            ("load-json-binary", load, {"ckpt/model_config.json": binary}, "model_config.json"),
            ("load-json-is-directory", load, {"ckpt/model_config.json": DIR}, "model_config.json"),
            ("load-json-text-layers", load, checkpoint(layers="four"), "model_config.json"),
            ("load-json-float-hidden", load, checkpoint(hidden=64.5), "hidden"),
            ("load-json-text-rope", load, checkpoint(rope_theta="big"), "rope_theta"),
            ("load-json-text-bool", load, checkpoint(tie_embeddings="yes"), "tie_embeddings"),
            ("load-json-unknown-field", load, checkpoint(colour=1), "colour"),
            ("load-json-zero-heads", load, checkpoint(heads=0), "heads"),
            ("load-broken-tokenizer", load, {**checkpoint(), "ckpt/tokenizer/tokenizer.json": "{broken"},
             "tokenizer"),
            ("tokenizer-missing", [*sentencepiece, "{tmp}/missing.model"], {}, "missing.model"),
            ("tokenizer-directory", [*sentencepiece, "{tmp}/tok"], {"tok": DIR}, "tok"),
            ("tokenizer-binary", [*sentencepiece, "{tmp}/junk.model"], {"junk.model": binary}, "junk.model"),
            ("tokenizer-empty", [*sentencepiece, "{tmp}/empty.model"], {"empty.model": b""}, "empty.model"),
            ("tokenizer-empty-path", [*sentencepiece, ""], {}, "tokenizer-model"),
            ("hf-tokenizer-empty-directory", [*huggingface, "{tmp}/hf"], {"hf": DIR}, "tokenizer.json"),
            ("hf-tokenizer-broken", [*huggingface, "{tmp}/tokenizer.json"], {"tokenizer.json": "{broken"},
             "tokenizer.json"),
            ("hf-tokenizer-binary", [*huggingface, "{tmp}/tokenizer.json"], {"tokenizer.json": binary},
             "tokenizer.json"),
            ("save-file", ["--save", "{tmp}/file"], {"file": "x"}, "--save"),
            ("save-empty-path", ["--save", ""], {}, "--save"),
            ("output-dir-file", ["--output-dir", "{tmp}/file"], {"file": "x"}, "--output-dir"),
            ("output-dir-below-file", ["--output-dir", "{tmp}/file/sub"], {"file": "x"}, "--output-dir"),
            ("tensorboard-dir-file", ["--tensorboard-dir", "{tmp}/file"], {"file": "x"}, "--tensorboard-dir"),
    ):
        cases.append(Case(f"path-{name}", "missing path / wrong kind of path", argv, files, needle=needle))
    cases.append(_yaml_case("path-yaml-load-missing", "missing path / wrong kind of path", "load: {tmp}/missing\n",
                            needle="missing"))

    # 9. impossible layouts (the world size as torchrun would set it).
    for name, argv, world, needle in (
            ("tp-above-world", ["--tensor-model-parallel-size", "2"], 1, "world size 1"),
            ("tp-not-dividing-heads", ["--tensor-model-parallel-size", "3"], 3, "tensor-parallel"),
            ("tp-above-heads", ["--tensor-model-parallel-size", "8"], 8, "tensor-parallel"),
            ("pp-not-dividing-layers", ["--pipeline-model-parallel-size", "3"], 3, "pipeline-parallel"),
            ("pp-above-layers", ["--pipeline-model-parallel-size", "8"], 8, "pipeline-parallel"),
            ("tp-pp-not-dividing-world", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
             6, "world size 6"),
            ("prompts-not-dividing-dp", ["--prompts-per-step", "3"], 2, "--prompts-per-step"),
            ("micro-batch-not-dividing", ["--micro-batch-size", "3"], 1, "--micro-batch-size"),
            ("micro-batch-not-dividing-dp2", ["--micro-batch-size", "5", "--prompts-per-step", "4", "--group-size", "4"],
             2, "--micro-batch-size"),
            ("rank-above-hidden", ["--optimizer", "logra", "--logra-rank", "100"], 1, "--logra-rank"),
            ("tp-not-dividing-smollm2-heads", ["--preset", "smollm2-135m", "--tensor-model-parallel-size", "2"], 2,
             "tensor-parallel"),
            ("checkpoint-heads-vs-tp", ["--load", "{tmp}/ckpt", "--tensor-model-parallel-size", "4"], 4,
             "tensor-parallel"),
            ("world-size-0", [], 0, "world size"),
            ("world-size-text", [], "two", "WORLD_SIZE"),
    ):
        files = checkpoint(kv_heads=2) if "{tmp}/ckpt" in argv else {}
        cases.append(Case(f"layout-{name}", "impossible layout", argv, files, world_size=world, needle=needle))

    # 10. contradictory or impossible combinations.
    for name, argv, needle in (
            ("bf16-sr-without-bf16", ["--logra-master", "bf16-sr"], "--bf16"),
            ("tokenizer-type-alone", ["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model"),
            ("tokenizer-model-alone", ["--tokenizer-model", "{tmp}/tokenizer.json"], "--tokenizer-type"),
            ("min-lr-above-lr", ["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
            ("warmup-min-lr-above", ["--warmup-lr", "1e-4", "--warmup-min-lr", "1e-3"], "--warmup-min-lr"),
            ("greedy-rl", ["--temperature", "0"], "--temperature"),
            ("new-tokens-above-max-seq", ["--max-new-tokens", "1000"], "--max-new-tokens"),
            ("eval-prompts-above-held-out", ["--max-operand", "2", "--eval-prompts", "150"], "--eval-prompts"),
            ("prompts-above-training-problems", ["--max-operand", "1", "--prompts-per-step", "16", "--eval-prompts", "1",
                                                 "--warmup-iters", "0", "--held-out-fraction", "0.5"],
             "--prompts-per-step"),
            ("task-too-small", ["--max-operand", "5"], "--max-operand"),
            ("ckpt-step-without-load", ["--ckpt-step", "3"], "--load"),
    ):
        if name.startswith("ckpt-step") and "--ckpt-step" not in BY_FLAG:
            continue
        files = {"tokenizer.json": "{}"} if "{tmp}/tokenizer.json" in argv else {}
        cases.append(Case(f"combo-{name}", "contradictory combination", argv, files, needle=needle))
    cases.append(_yaml_case("combo-yaml-bf16-sr", "contradictory combination", "logra-master: bf16-sr\n",
                            needle="--bf16"))
    cases.append(_yaml_case("combo-yaml-vs-flag", "contradictory combination", "bf16: true\nlogra_master: bf16-sr\n",
                            needle="--min-lr", argv=["--lr", "0", "--min-lr", "1e-4"]))

    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    return cases


CASES = generated_cases()


# --- running a case ----------------------------------------------------------------------------

def _materialize(case: Case, tmp_path) -> List[str]:
    tmp = str(tmp_path)
    for relative, content in case.files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is DIR:
            path.mkdir(exist_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{tmp}", tmp))
    return [arg.replace("{tmp}", tmp) for arg in case.argv]


def _check_one_error_line(stderr: str, case: Case) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: ") and len(line) > len("error: "), line
    if case.needle is not None:
        normal = line.lower().replace("_", "-")
        assert case.needle.lower().replace("_", "-") in normal, f"{case.needle!r} not named in: {line}"
    return line


@pytest.fixture
def entry_point(monkeypatch):
    """``logra_megatron.train.main`` with the trainer and process groups replaced: a case that
    passes validation reaches ``train`` and fails the test instead of training."""
    def train(config):
        pytest.fail(f"the case validated and training would start (model {config.model_config})")

    trainer = types.ModuleType("logra_megatron.rl.trainer")
    trainer.train = train
    parallel = types.ModuleType("logra_megatron.parallel")
    parallel.destroy = lambda: None
    monkeypatch.setitem(sys.modules, "logra_megatron.rl.trainer", trainer)
    monkeypatch.setitem(sys.modules, "logra_megatron.parallel", parallel)
    monkeypatch.setattr(logra_megatron.rl, "trainer", trainer, raising=False)
    monkeypatch.setattr(logra_megatron, "parallel", parallel, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    from logra_megatron.train import main

    return main


def test_the_fuzzer_covers_enough_and_every_category():
    assert len(CASES) >= 50
    categories = {case.category for case in CASES}
    assert categories == {
        "wrong type (flag)", "negative / zero / non-finite number", "unknown flag / missing value",
        "YAML: wrong type / empty value", "YAML: unknown key", "YAML: wrong shape", "YAML: broken syntax",
        "YAML: empty / binary / not UTF-8", "missing path / wrong kind of path", "impossible layout",
        "contradictory combination"}
    # every option of the schema is fuzzed on the command line or in YAML, every path option with paths
    for option in OPTIONS:
        assert any(option.flag in case.argv or f"-{option.key}" in case.id for case in CASES), option.flag
    for flag in PATH_OPTIONS:
        assert any(flag in case.argv for case in CASES if case.category == "missing path / wrong kind of path"), flag
    assert [case.id for case in generated_cases()] == [case.id for case in CASES]  # deterministic


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_malformed_input_is_one_error_line_and_exit_2(case, entry_point, tmp_path, monkeypatch, capsys):
    argv = _materialize(case, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(case.world_size))
    with pytest.raises(SystemExit) as exit_info:
        entry_point(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    _check_one_error_line(captured.err, case)


SUBPROCESS_CASES = ["type-micro-batch-size", "yaml-syntax-unclosed-list", "yaml-bytes-latin-1", "path-load-json-broken",
                    "layout-tp-not-dividing-heads"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_the_real_entry_point_behaves_the_same(case_id, tmp_path):
    case = next(case for case in CASES if case.id == case_id)
    argv = _materialize(case, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WORLD_SIZE=str(case.world_size))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.train", *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _check_one_error_line(proc.stderr, case)
    assert proc.stdout == ""


def test_every_flag_of_the_parser_is_in_the_schema():
    """The fuzzer derives its flags from the schema; the parser must not have others."""
    parser = build_parser()
    flags = {s for action in parser._actions for s in action.option_strings}
    # A negative switch's Megatron spelling (--exit-signal-handler) is its second flag, in the schema too.
    positive = {spec["positive_flag"] for section, _ in SECTIONS
                for _item, spec in schema.options_of(_section_class(section)) if spec.get("positive_flag")}
    assert positive == {"--exit-signal-handler"}
    assert flags == set(BY_FLAG) | positive | {"--config", "-h", "--help"}
