#!/usr/bin/env bash
# The main job on its embedded default: no download, CPU is fine.
# Creates or reuses .venv, installs, then runs the smoke job of the `tiny` preset at TP=2 under
# torchrun with the LoGRA optimizer (forward/backward through Megatron's pipeline schedule, sketch-space Adam steps).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh" ""
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
torchrun --nproc-per-node 2 -m logra_megatron.smoke --tensor-model-parallel-size 2 --optimizer logra "$@"
