"""tools/benchmark_packing.py on tiny: the padded and packed rows of one GRPO step (same rows, same
weights: the same loss), their ratio, the length distribution it says it used, as JSON and as a
table; and the engine's prefill padded vs packed (tokens computed, time, the evaluation's passes,
the same completions)."""

import json
import os
import subprocess
import sys

from dist_harness import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
ARGS = ["tools/benchmark_packing.py", "--preset", "tiny", "--rows", "8", "--response-cap", "48",
        "--repeats", "1", "--micro-batch-size", "2", "--engine-prompts", "6", "--engine-samples", "3",
        "--engine-new-tokens", "4"]


def test_padded_and_packed_rows_and_their_ratio_as_json():
    proc = subprocess.run([sys.executable, *ARGS, "--json"], capture_output=True, text=True, timeout=600,
                          env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["ratio"]) == {"tokens_per_s", "peak_bytes"}
    for side in ("padded", "packed"):
        row = report[side]
        assert row["tokens_per_s"] > 0 and row["peak_bytes"] > 0 and row["microbatches"] >= 1, (side, row)
    assert report["ratio"]["tokens_per_s"] == report["packed"]["tokens_per_s"] / report["padded"]["tokens_per_s"]
    assert abs(report["packed"]["first_loss"] - report["padded"]["first_loss"]) < 1e-5
    assert report["packed"]["computed_tokens"] == report["real_tokens"] < report["padded_cells"]
    assert 0 < report["padding_fraction"] < 1 and "log-normal" in report["lengths"]["source"]
    engine = report["engine"]
    assert engine["rows"] == 6 * 3 and engine["served_prompt_tokens"] == 3 * engine["prompt_tokens"]
    # packed: each distinct prompt's real tokens once; padded: every row at the longest prompt
    assert engine["packed"]["prefill_computed_tokens"] == engine["prompt_tokens"]
    assert engine["padded"]["prefill_computed_tokens"] == engine["padded_cells"] > engine["served_prompt_tokens"]
    assert engine["ratio"]["prefill_computed_tokens"] == engine["prompt_tokens"] / engine["padded_cells"]
    for side in ("padded", "packed"):
        assert engine[side]["prefill_s"] > 0 and engine[side]["evaluation_s"] > 0
    assert engine["identical"] == {"greedy": True, "sampled": True}


def test_the_table():
    proc = subprocess.run([sys.executable, *ARGS], capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| padded |" in proc.stdout and "| packed |" in proc.stdout and "packed / padded" in proc.stdout
    assert "padding" in proc.stdout and "log-normal" in proc.stdout
    assert "| prefill | computed tokens |" in proc.stdout
    assert "completions identical packed and padded: greedy yes, sampled yes" in proc.stdout
