#!/usr/bin/env bash
# The GPU check: one prepared run of the stages that need a GPU (tools/gpu_check.py lists them),
# for a machine with no package registry. Usage:
#   bash launch/gpu_check.sh [--cpu] [--wheels DIR] [--stages a,b] OUT_DIR
# --wheels DIR: megatron-core's wheel (and any other small wheel) to install when megatron-core
# does not import; the README gives the `pip download` line that makes DIR. --cpu: the same
# stages on the tiny preset on the CPU (what CI runs). Writes OUT_DIR/report.json, report.md and
# stages.log; exits 1 when a stage failed. The `baselines` stage (precision-aware Adam, CPU offload
# and LoGRA on qwen2.5-1.5b, docs/BASELINES.md) needs CUDA: --cpu reports it skipped.
set -uo pipefail
# The Python: PYTHON, else the project's .venv when it exists, else python3 (launch/python_env.sh).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/python_env.sh"
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
if ! "$PYTHON" -c "import megatron.core" >/dev/null 2>&1; then
    if [ -z "$WHEELS" ]; then
        echo "error: megatron-core does not import; pass --wheels DIR with its wheel (see the README)" >&2
        exit 2
    fi
    SITE="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec "$PYTHON" "$ROOT/tools/gpu_check.py" "${ARGS[@]}"
