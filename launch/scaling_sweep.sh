#!/usr/bin/env bash
# The TP/PP scaling test: the smoke job at every TP x PP layout of NPROC ranks (DP fills the
# rest), Megatron's dense Adam and LoGRA, one measured step each; then one table of training
# state per rank, peak step memory, step time, bytes passed to TP / PP / DP collectives, loss.
#
#   bash launch/scaling_sweep.sh [--out DIR] [--steps N] [--nproc N] [--preset NAME]
#        [--layouts "1x1 1x2 ..."] [--optimizers "adam logra"] [-- SMOKE ARGS...]
#
# Defaults: --out runs/scaling_sweep, --steps 3, --nproc 4, --preset tiny, every TPxPP with
# TP, PP in {1, 2, 4}, both optimizers. A layout the model or the rank count does not divide
# is listed as skipped, with the reason. Arguments after -- go to every smoke run (e.g.
# --logra-rank 16, --seq-length 64). Per run: DIR/tp{T}_pp{P}_{optimizer}.{json,log}; the
# table: DIR/table.md and DIR/table.json. Exit status 1 when a run failed.
# LOGRA_SKIP_SETUP=1 installs nothing: the Python is PYTHON, else the project's .venv when it
# exists, else python3 (launch/python_env.sh; the script says which).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="runs/scaling_sweep"; STEPS=3; NPROC=4; PRESET="tiny"; OPTIMIZERS="adam logra"
LAYOUTS="1x1 1x2 1x4 2x1 2x2 2x4 4x1 4x2 4x4"
SMOKE_ARGS=()
usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --steps) STEPS="$2"; shift 2 ;;
        --nproc) NPROC="$2"; shift 2 ;;
        --preset) PRESET="$2"; shift 2 ;;
        --layouts) LAYOUTS="$2"; shift 2 ;;
        --optimizers) OPTIMIZERS="$2"; shift 2 ;;
        --) shift; SMOKE_ARGS=("$@"); break ;;
        -h|--help) usage ;;
        *) echo "scaling_sweep: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ "${LOGRA_SKIP_SETUP:-0}" != "1" ]; then
    source "$ROOT/launch/setup_env.sh" ""
else
    source "$ROOT/launch/python_env.sh"
fi
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$OUT"

failed=0
for layout in $LAYOUTS; do
    TP="${layout%x*}"; PP="${layout#*x}"
    for OPTIMIZER in $OPTIMIZERS; do
        NAME="tp${TP}_pp${PP}_${OPTIMIZER}"
        rm -f "$OUT/$NAME.json" "$OUT/$NAME.skip" "$OUT/$NAME.log"
        ARGS=(--preset "$PRESET" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
              --optimizer "$OPTIMIZER" --train-iters "$STEPS" "${SMOKE_ARGS[@]}")
        status=0
        reason="$("$PYTHON" tools/scaling_sweep.py check --nproc "$NPROC" -- "${ARGS[@]}" 2>&1)" || status=$?
        if [ "$status" = 3 ]; then
            echo "$reason" > "$OUT/$NAME.skip"
            echo "[sweep] $NAME: skipped: $reason"
            continue
        elif [ "$status" != 0 ]; then
            echo "[sweep] bad arguments: $reason" >&2
            exit 2
        fi
        echo "[sweep] $NAME: running on $NPROC ranks ($STEPS steps + 1 measured)"
        if ! "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
                -m logra_megatron.smoke "${ARGS[@]}" --report-json "$OUT/$NAME.json" \
                > "$OUT/$NAME.log" 2>&1; then
            echo "[sweep] $NAME: FAILED, see $OUT/$NAME.log" >&2
            failed=1
        fi
    done
done
"$PYTHON" tools/scaling_sweep.py table --out "$OUT" --layouts "$LAYOUTS" --optimizers "$OPTIMIZERS" \
    --nproc "$NPROC"
echo "[sweep] table: $OUT/table.md, $OUT/table.json"
exit "$failed"
