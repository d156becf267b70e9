"""Imports point down: for the layer order written in docs/ARCHITECTURE.md, importing a module
never imports a module of a higher layer (checked in a fresh interpreter through sys.modules),
and no function-level import reaches up a layer either (checked on the source)."""

import ast
import json
import re
import subprocess
import sys

from dist_harness import REPO

PACKAGE = REPO / "logra_megatron"


def layers() -> list:
    """``[(layer name, [module prefixes])]`` bottom to top, from the table in ARCHITECTURE.md."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    found = []
    for line in block.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and re.match(r"^\d+ ", cells[0]):
            found.append((cells[0], re.findall(r"`([\w.]+)`", cells[1])))
    assert len(found) >= 8, block
    return found


def all_modules() -> list:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def layer_of(module: str, table) -> int:
    best = None
    for index, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    table = layers()
    missing = [name for name in all_modules() if name != "logra_megatron" and layer_of(name, table) is None]
    assert not missing, f"modules without a layer in docs/ARCHITECTURE.md: {missing}"


def test_importing_a_module_imports_nothing_above_its_layer():
    table = layers()
    ordered = sorted((m for m in all_modules() if m != "logra_megatron" and not m.endswith("__main__")),
                     key=lambda name: (layer_of(name, table), name))
    script = f"""
import importlib, json, sys
table = {table!r}
def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]
violations = []
for name in {ordered!r}:
    importlib.import_module(name)
    own = layer_of(name)
    above = sorted(m for m in sys.modules if m.startswith("logra_megatron.")
                   and layer_of(m) is not None and layer_of(m) > own)
    if above:
        violations.append([name, above])
        break  # everything imported later would be blamed too
print(json.dumps(violations))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    violations = json.loads(proc.stdout.strip().splitlines()[-1])
    assert violations == [], violations


def _function_level_imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module:
                    yield inner.lineno, inner.module
                elif isinstance(inner, ast.Import):
                    for alias in inner.names:
                        yield inner.lineno, alias.name


def test_no_function_level_import_reaches_up_a_layer():
    table = layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        # The package root is the front door: its lazy re-exports (``logra_megatron.get_logra_optimizer``)
        # may reach any layer, as an import of the package by a user would.
        own = len(table) if module == "logra_megatron" else layer_of(module, table)
        for line, imported in _function_level_imports(path):
            if imported.startswith("logra_megatron") and (layer_of(imported, table) or 0) > own:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert not upward, upward
