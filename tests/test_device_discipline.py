"""Device discipline, checked without a GPU: every tensor the package (and its tools) creates
names the device it serves, or is one of the places listed below where the CPU is meant.

On a GPU a tensor created without ``device=`` lands on the CPU, and the first op that meets a
CUDA tensor fails (or, worse, a whole optimizer state silently lives in host memory and every
memory figure leaves it out). That is how main at 8318391 failed on an H200 on its first step
(../shared/GPU_ON_H200.md). This test reads the source (AST) and lists every call of a tensor
factory that names no device; ``*_like`` / ``new_*`` forms inherit a device and are fine.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("logra_megatron", "tools")
FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "eye", "linspace",
             "tensor", "as_tensor", "Generator"}

# (file, enclosing function, factory) -> why the CPU is meant there.
CPU_MEANT = {
    ("logra_megatron/smoke.py", "run", "Generator"):
        "the synthetic batch's token ids are drawn on the CPU so every device kind trains on the same batch; "
        "the rank's rows move to the model's device once",
    ("logra_megatron/smoke.py", "run", "randint"): "the same synthetic batch (see Generator)",
    ("logra_megatron/planning/validate.py", "measure_settings", "Generator"):
        "the validation batch's token ids, drawn on the CPU (the same on every device kind), moved once",
    ("logra_megatron/planning/validate.py", "measure_settings", "randint"): "the same validation batch",
    ("tools/benchmark_optimizer.py", "run_child", "Generator"):
        "the benchmark batch's token ids, drawn on the CPU (the same on every device kind), moved once",
    ("tools/benchmark_optimizer.py", "run_child", "randint"): "the same benchmark batch",
    ("tools/benchmark_step_phases.py", "run_child", "Generator"):
        "the timed batch's token ids, drawn on the CPU (the same on every device kind), moved once",
    ("tools/benchmark_step_phases.py", "run_child", "randint"): "the same timed batch",
    ("logra_megatron/rl/trainer.py", "supervised_batch", "full"):
        "the warm-up batch is assembled on the host from token lists; lm_forward_backward moves it",
    ("logra_megatron/rl/trainer.py", "supervised_batch", "zeros"): "its loss mask, assembled with it on the host",
    ("logra_megatron/rl/trainer.py", "supervised_batch", "tensor"): "one row of host token ids",
    ("logra_megatron/rl/advantages.py", "group_advantages", "as_tensor"):
        "a tensor keeps its device; a list of host rewards (tests) becomes a CPU tensor",
    ("logra_megatron/convert/reference.py", "encode_prompts", "Generator"):
        "random prompt token ids for tiny test models, returned as Python lists (tokenization is host work)",
    ("logra_megatron/convert/reference.py", "encode_prompts", "randint"): "the same prompts",
    ("logra_megatron/convert/runtime.py", "right_pad", "tensor"):
        "host token lists padded into a batch; forward_logits moves it to the model's device",
    ("tools/benchmark_peers.py", "batch", "tensor"):
        "arithmetic text tokenized on the host; the benchmark moves each batch to the device before training",
    ("tools/benchmark_policy_sync.py", "run", "Generator"):
        "the benchmark's token ids, drawn on the CPU; lm_forward_backward moves them",
    ("tools/benchmark_policy_sync.py", "run", "randint"): "the same token ids",
    ("tools/single_gpu_rl_step.py", "run_steps", "Generator"):
        "synthetic prompts as host token lists (a tokenizer's output) and rewards as a host verifier gives them",
    ("tools/single_gpu_rl_step.py", "rl_step", "randint"): "the same synthetic prompts and rewards",
    ("tools/kl_control_demo.py", "main", "Generator"):
        "the demo's token ids, drawn on the CPU; the forward passes move them to the model's device",
    ("tools/kl_control_demo.py", "main", "randint"): "the same token ids",
}


def _deviceless_factory_calls(path: Path):
    """``(function, factory, line)`` of each ``torch.<factory>(...)`` without ``device=``."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch"
                    and not any(keyword.arg == "device" for keyword in child.keywords)):
                found.append((function, child.func.attr, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def _scan():
    calls = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            calls += [(relative, function, factory, line) for function, factory, line in _deviceless_factory_calls(path)]
    return calls


def test_every_tensor_factory_names_its_device_or_is_a_listed_cpu_place():
    unlisted = [f"{path}:{line} torch.{factory}() in {function}() names no device"
                for path, function, factory, line in _scan() if (path, function, factory) not in CPU_MEANT]
    assert not unlisted, (
        "tensors created without a device (on a GPU they land on the CPU): pass device= (or use a "
        "*_like / new_* form); where the CPU is meant, add the place to CPU_MEANT with its reason:\n"
        + "\n".join(unlisted))


def test_every_listed_cpu_place_still_exists():
    """A listed place that no longer creates a CPU tensor is a stale exception: remove it."""
    present = {(path, function, factory) for path, function, factory, _ in _scan()}
    stale = sorted(set(CPU_MEANT) - present)
    assert not stale, f"CPU_MEANT lists places that create no CPU tensor any more: {stale}"


def test_the_scan_finds_a_deviceless_factory(tmp_path):
    """The scanner itself: it flags what it must and passes what it must."""
    source = tmp_path / "example.py"
    source.write_text(
        "import torch\n"
        "def f(x):\n"
        "    a = torch.zeros(3)\n"                       # flagged
        "    b = torch.zeros(3, device=x.device)\n"      # fine
        "    c = torch.zeros_like(x)\n"                  # fine
        "    g = torch.Generator()\n"                    # flagged
        "    return x.new_empty(2)\n")                   # fine
    assert _deviceless_factory_calls(source) == [("f", "zeros", 3), ("f", "Generator", 6)]
