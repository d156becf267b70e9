#!/usr/bin/env bash
# Multi-node launch under SLURM: one torchrun per node, rendezvous on the first node.
#   sbatch --nodes 2 --gpus-per-node 8 launch/slurm_multi_node.sh logra_megatron.smoke \
#       --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2
#SBATCH --job-name=logra
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: sbatch $0 MODULE [ARGS...]" >&2
    exit 2
fi
MODULE="$1"; shift
ROOT="${LOGRA_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${MASTER_PORT:-29500}"
source "$ROOT/launch/python_env.sh"  # PYTHON, else ROOT/.venv when it exists, else python3
srun --kill-on-bad-exit=1 bash -c "
  cd '$ROOT' &&
  '$PYTHON' -m torch.distributed.run --nnodes \$SLURM_NNODES --node-rank \$SLURM_NODEID --nproc-per-node $GPUS_PER_NODE \
    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m $MODULE $*"
