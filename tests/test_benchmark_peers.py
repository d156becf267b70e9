"""tools/benchmark_peers.py on `tiny`, 2 steps: every requested row has its figures or says why
not, and all rows start from the same weights.

APOLLO is blocked on purpose (a package on PYTHONPATH that fails to import, as on a machine
without apollo-torch) so the not-available path is checked wherever the peers are installed;
GaLore runs when galore-torch imports here and must say "not available" otherwise. The
distributed-optimizer row (torchrun, 2 ranks) and the reference rule's row are left out to keep
the test short: they run through the same child code.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROWS = ("megatron-adam", "logra-r8-none", "torch-adamw", "galore-r8", "apollo-r8")  # the tool's order
COMPONENTS = ("weight_bytes", "master_bytes", "grad_bytes", "sketch_bytes", "moment_bytes",
              "projection_bytes", "controller_extra_bytes")


def test_peer_rows_share_weights_and_report_every_figure(tmp_path):
    blocked = tmp_path / "blocked" / "apollo_torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("blocked by the test")\n')
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")])))
    out, table = tmp_path / "peers.json", tmp_path / "peers.md"
    proc = subprocess.run(
        [sys.executable, "tools/benchmark_peers.py", "--preset", "tiny", "--ranks", "8", "--steps", "2",
         "--seq-length", "16", "--bf16", "--logra-masters", "none", "--rows", ",".join(ROWS),
         "--json", "--out", str(out), "--markdown", str(table)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    rows = {row["key"]: row for row in report["rows"]}
    assert tuple(rows) == ROWS
    assert "[peers] (5/5) apollo-r8" in proc.stderr  # progress goes to stderr

    apollo = rows["apollo-r8"]
    assert apollo["available"] is False
    assert apollo["reason"].startswith("not available: apollo-torch does not import") and "blocked by the test" in apollo["reason"]
    if not rows["galore-r8"]["available"]:
        assert rows["galore-r8"]["reason"].startswith("not available: galore-torch")

    ran = {key: row for key, row in rows.items() if row["available"]}
    assert {"torch-adamw", "megatron-adam", "logra-r8-none"} <= set(ran)
    for row in ran.values():
        assert row["training_state_bytes"] == sum(row[key] for key in COMPONENTS)
        assert row["weight_bytes"] == ran["megatron-adam"]["weight_bytes"] > 0
        assert row["peak_step_bytes"] > 0 and row["step_time_s"] > 0
        for key in ("first_loss", "final_loss", "initial_eval_loss", "eval_loss"):
            assert math.isfinite(row[key]) and row[key] > 0
        assert row["eval_loss"] < row["initial_eval_loss"]  # every optimizer learned something
    # Same initial weights and batches in every process.
    assert report["same_start"] is True
    assert len({row["first_loss"] for row in ran.values()}) == 1
    assert len({row["initial_eval_loss"] for row in ran.values()}) == 1

    # bf16 weights (2 bytes/param): Megatron's Adam keeps fp32 grads, masters and moments; torch
    # AdamW keeps bf16 grads and moments; LoGRA's sketched weights have no dense grad or master.
    torch_adamw, megatron, logra = ran["torch-adamw"], ran["megatron-adam"], ran["logra-r8-none"]
    weights = megatron["weight_bytes"]
    assert megatron["grad_bytes"] == megatron["master_bytes"] == 2 * weights
    assert torch_adamw["grad_bytes"] == weights and torch_adamw["master_bytes"] == 0
    assert 2 * weights <= torch_adamw["moment_bytes"] < 2.1 * weights
    assert logra["sketch_bytes"] > 0 and logra["projection_bytes"] > 0
    assert logra["grad_bytes"] < 0.5 * megatron["grad_bytes"]
    assert logra["training_state_bytes"] < 0.5 * megatron["training_state_bytes"]
    assert 0 < logra["state_vs_megatron_adam"] < 0.5
    if "galore-r8" in ran:
        galore = ran["galore-r8"]
        assert galore["projection_bytes"] > 0 and galore["moment_bytes"] < torch_adamw["moment_bytes"]

    text = table.read_text()
    for row in rows.values():
        assert f"| {row['label']} |" in text
    assert "not available: apollo-torch" in text
