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
# The repository: LOGRA_ROOT when set; else the directory sbatch was run from when it is this
# repository (under sbatch this file is Slurm's spool copy, so its own path says nothing); else
# where this file lies (run by hand).
if [ -n "${LOGRA_ROOT:-}" ]; then
    ROOT="$LOGRA_ROOT"
elif [ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/launch/slurm_multi_node.sh" ]; then
    ROOT="$SLURM_SUBMIT_DIR"
else
    ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fi
if [ ! -f "$ROOT/launch/python_env.sh" ]; then
    echo "error: cannot find the logra_megatron repository (got $ROOT): run sbatch from it or set LOGRA_ROOT" >&2
    exit 2
fi
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
# The first node hosts the rendezvous. (awk reads every line: with head, scontrol could die of
# SIGPIPE on a long node list and pipefail would end the job.)
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')"
MASTER_PORT="${MASTER_PORT:-29500}"
source "$ROOT/launch/python_env.sh"  # PYTHON, else ROOT/.venv when it exists, else python3
# Every value travels as its own argument of bash -c (an argument holding a space or JSON stays
# one argument); only the node's rank and count are read on the node.
# Checkpoints: --save/--load must name a filesystem every node sees (rank 0 writes the tracker,
# every rank writes its shards and reads them back on --load).
srun --kill-on-bad-exit=1 bash -c 'cd "$0" && exec "$1" -m torch.distributed.run --nnodes "$SLURM_NNODES" \
    --node-rank "$SLURM_NODEID" --nproc-per-node "$2" --rdzv-backend c10d --rdzv-endpoint "$3" -m "${@:4}"' \
    "$ROOT" "$PYTHON" "$GPUS_PER_NODE" "$MASTER_ADDR:$MASTER_PORT" "$MODULE" "$@"
