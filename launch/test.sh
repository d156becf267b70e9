#!/usr/bin/env bash
# Install the test extras (vLLM's CPU build included: the rollout tests) into .venv (created if
# missing) and run the whole test suite on CPU.
# Extra arguments go to pytest (e.g. `bash launch/test.sh tests/test_parallel_exactness.py`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh" "test,hf,rl,plot,rollout"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" -m pytest -q "$@"
