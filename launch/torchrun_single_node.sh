#!/usr/bin/env bash
# One node, N processes: bash launch/torchrun_single_node.sh [--max-restarts K] NPROC MODULE [ARGS...]
# e.g. bash launch/torchrun_single_node.sh 4 logra_megatron.smoke \
#        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
# With --max-restarts K, torchrun restarts the whole job up to K times when a rank dies; the
# restarted trainer (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest complete checkpoint
# under --load, or without --load under --save (it says which on its first line; with nothing
# saved yet it starts over). Give --save with --save-interval N so a restart loses at most N steps.
# LOGRA_SKIP_SETUP=1 installs nothing: the Python is PYTHON, else the project's .venv when it
# exists, else python3 (launch/python_env.sh; the script says which).
set -euo pipefail
RESTARTS=()
if [ "${1:-}" = "--max-restarts" ]; then
    RESTARTS=(--max-restarts "$2"); shift 2
fi
if [ $# -lt 2 ]; then
    echo "usage: $0 [--max-restarts K] NPROC MODULE [ARGS...]" >&2
    exit 2
fi
NPROC="$1"; MODULE="$2"; shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${LOGRA_SKIP_SETUP:-0}" != "1" ]; then
    source "$ROOT/launch/setup_env.sh" ""
else
    source "$ROOT/launch/python_env.sh"
fi
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run --standalone "${RESTARTS[@]}" --nproc-per-node "$NPROC" -m "$MODULE" "$@"
