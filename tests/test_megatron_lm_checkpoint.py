"""Megatron-LM checkpoints as ``--load`` (issue 34, item 3): a torch_dist directory written the
way Megatron-LM writes it (its ``args`` in the common state, no ``model_config.json``) gives the
architecture, and its weights load at TP=2, TP=1 and PP=2 with the source model's logits; the
trainer starts from it by ``--load`` alone (tokenizer from its args) and its own checkpoints
record Megatron-LM's args in turn; args outside our model family, a tokenizer that is not here and
an unfinished save are one error line each."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from dist_harness import REPO, result, run_workers
from local_tokenizers import hf_tokenizer_folder

from logra_megatron.checkpoint import load_model_config
from logra_megatron.checkpoint_args import megatron_lm_args, model_config_from_args, read_checkpoint_args
from logra_megatron.checkpoint_layout import TRACKER_FILE, iteration_dir
from logra_megatron.models import PRESETS

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
# The source's logits are fp32 sums over 4 layers of width 64: the layouts differ in summation
# order only (measured: ~1e-6 of a logit scale of ~1).
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_lm")
    tokenizer = hf_tokenizer_folder(out / "hf_tokenizer")
    results = run_workers("megatron_lm_checkpoint_checks.py", 2, out / "workers", args=["--tokenizer", tokenizer])
    return {"results": results, "root": out / "workers" / "megatron_lm_run", "tokenizer": tokenizer}


def test_the_architecture_comes_from_megatron_lms_args(written):
    selected = result(written["results"], "selected")
    assert selected["iteration"] == 7 and selected["directory"] == "iter_0000007"
    model = selected["model"]
    assert (model["layers"], model["hidden"], model["heads"], model["kv_heads"], model["ffn_hidden"]) == \
        (4, 64, 4, 2, 128)
    # Megatron-LM's padded_vocab_size (120 ids rounded to 128 x TP 2), untied, Qwen2's QKV bias.
    assert model["vocab"] == 256 and model["tie_embeddings"] is False and model["qkv_bias"] is True
    assert (model["rope_theta"], model["norm_eps"], model["max_seq"]) == (1000000.0, 1e-6, 256)


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp1", "tp1_pp2"])
def test_the_weights_load_at_any_layout_with_the_sources_logits(written, layout):
    last = [result(written["results"], f"logits_{layout}", rank) for rank in range(2)]
    checked = [value for value in last if value["last_stage"]]
    assert checked, last
    for value in checked:
        assert value["max_abs_diff"] < LOGIT_TOLERANCE * value["scale"], value


def test_the_trainer_starts_from_it_by_load_alone_and_saves_megatron_lm_args(written, tmp_path):
    save, out = tmp_path / "ckpt", tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "logra_megatron.train", "--load", str(written["root"]),
         "--max-operand", "4", "--train-iters", "1", "--eval-prompts", "4", "--prompts-per-step", "2",
         "--group-size", "2", "--micro-batch-size", "4", "--kl-probe-sequences", "2", "--no-progress",
         "--save", str(save), "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["finished"] is True
    assert "no supervised warm-up (a checkpoint is loaded)" in proc.stdout
    saved = iteration_dir(str(save), 1)
    args = read_checkpoint_args(saved)
    loaded = model_config_from_args(read_checkpoint_args(os.path.join(written["root"], "iter_0000007")), "source")
    assert model_config_from_args(args, saved) == loaded
    assert (args.iteration, args.tensor_model_parallel_size, args.tokenizer_type) == (1, 1, "HuggingFaceTokenizer")
    # The tokenizer travels with the checkpoint, so resuming from it needs no flag either.
    assert (save / "iter_0000001" / "tokenizer" / "tokenizer.json").is_file()


def test_the_smoke_job_loads_the_save_root_too(written):
    proc = subprocess.run(
        [sys.executable, "-m", "logra_megatron.smoke", "--load", str(written["root"]), "--train-iters", "1",
         "--seq-length", "16", "--global-batch-size", "2", "--micro-batch-size", "2"],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    loaded = load_model_config(os.path.join(written["root"], "iter_0000007"))
    assert loaded != PRESETS["tiny"] and f"params={loaded.num_parameters():,}" in proc.stdout, proc.stdout[-2000:]
    assert "step 1/1 loss" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_our_args_read_back_to_the_same_model(name):
    model = PRESETS[name]
    # Megatron-LM's args name no Hugging Face architecture: Mistral's network reads back as Llama's.
    family = "llama" if model.family == "mistral" else model.family
    for tensor_parallel in (1, 4):
        args = megatron_lm_args(model, tensor_parallel, 2)
        assert model_config_from_args(args, name) == model.with_changes(vocab=model.padded_vocab(tensor_parallel),
                                                                        family=family)


def _megatron_lm_iteration(root, tokenizer=None, complete=True, **changes):
    """A Megatron-LM iteration directory's files without tensors: the common state (args from
    megatron_lm_args with ``changes``), metadata.json and, when ``complete``, ``.metadata``."""
    directory = root / "iter_0000003"
    directory.mkdir(parents=True)
    args = megatron_lm_args(PRESETS["tiny"], 1, 1, iteration=3, tokenizer_type="HuggingFaceTokenizer" if tokenizer
                            else None, tokenizer_model=str(tokenizer) if tokenizer else None)
    vars(args).update(changes)
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    if complete:
        (directory / ".metadata").write_bytes(b"")
    (root / TRACKER_FILE).write_text("3")
    return root


@pytest.mark.parametrize("changes, message", [
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"swiglu": False}, "swiglu=False"),
    ({"num_experts": 8}, "num_experts=8"),
    ({"position_embedding_type": "learned_absolute", "use_rotary_position_embeddings": False},
     "position_embedding_type='learned_absolute'"),
])
def test_a_model_outside_our_family_is_one_error_line(tmp_path, capsys, changes, message):
    from logra_megatron.train import main

    root = _megatron_lm_iteration(tmp_path / "run", **changes)
    with pytest.raises(SystemExit) as stopped:
        main(["--load", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_a_tokenizer_that_is_not_here_is_one_error_line_naming_the_flags(tmp_path, capsys):
    from logra_megatron.train import main

    root = _megatron_lm_iteration(tmp_path / "run", tokenizer=tmp_path / "gone")
    with pytest.raises(SystemExit) as stopped:
        main(["--load", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "--tokenizer-model" in err[0] and "gone" in err[0], err


def test_an_unfinished_megatron_lm_save_is_skipped(tmp_path, capsys):
    from logra_megatron.train import main

    root = _megatron_lm_iteration(tmp_path / "run", complete=False)
    with pytest.raises(SystemExit) as stopped:
        main(["--load", str(root)])
    captured = capsys.readouterr()
    assert "no .metadata (Megatron-LM's save did not finish)" in captured.out
    err = captured.err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "no complete checkpoint" in err[0], err


def test_args_namespace_is_what_megatron_lms_loader_reads():
    """The names Megatron-LM's load_args_from_checkpoint copies are all in ours."""
    names = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
             "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
             "add_position_embedding", "use_rotary_position_embeddings", "rotary_percent", "add_bias_linear", "swiglu",
             "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "tokenizer_type",
             "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "virtual_pipeline_model_parallel_size")
    args = megatron_lm_args(PRESETS["qwen2.5-7b"], 2, 4)
    assert isinstance(args, argparse.Namespace) and not [name for name in names if not hasattr(args, name)]
