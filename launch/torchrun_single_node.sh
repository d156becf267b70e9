#!/usr/bin/env bash
# One node, N processes: bash launch/torchrun_single_node.sh NPROC MODULE [ARGS...]
# e.g. bash launch/torchrun_single_node.sh 4 logra_megatron.smoke \
#        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NPROC MODULE [ARGS...]" >&2
    exit 2
fi
NPROC="$1"; MODULE="$2"; shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh" ""
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc-per-node "$NPROC" -m "$MODULE" "$@"
