#!/usr/bin/env bash
# The main job on its embedded default: no download, CPU is fine.
# Creates or reuses .venv, installs, then runs the GRPO trainer on its embedded default: the
# `tiny` preset on the offline arithmetic task, a supervised warm-up, then GRPO with LoGRA and
# predicted-KL step control; it ends by printing the path of <output-dir>/summary.json.
# Extra arguments go to the trainer (e.g. --output-dir runs/mine, --optimizer adam).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh" ""
cd "$ROOT"
"$PYTHON" -m logra_megatron.train "$@"
