#!/usr/bin/env bash
# Dense Adam vs LoGRA parity runs (docs/results/README.md lists what they produced).
#
#   bash launch/parity_runs.sh KIND OUT search           the learning-rate search: every row at each lr, one seed
#   bash launch/parity_runs.sh KIND OUT [SEEDS...]       the seeded runs, every row at its search's best lr
#
# KIND: smollm2 (SmolLM2-135M-Instruct on reasoning-gym chain_sum) or tiny (the embedded default job).
# Rows (ROWS="logra adam-kl adam" by default):
#   logra        LoGRA with the predicted-KL controller (probe)
#   adam-kl      dense Adam under the same controller: the same --kl-target, --kl-max-scale and probe
#   adam         dense Adam without control (--kl-control off), as users run it
#   logra-decay  LoGRA with the KL budget decaying on a cosine to a tenth (--kl-target-final), as the
#                reference implementation's budget does (not in the default ROWS)
#   bf16-fp32    the main job at its defaults with --bf16 --logra-master fp32 (not in the default ROWS)
#   bf16-sr      the same with --logra-master bf16-sr: no master copy (not in the default ROWS)
# Environment: ROWS, LRS (the searched learning rates), SEARCH_SEED (the search's seed, apart from the
# seeded runs' so that no lr is scored on the run that chose it), ITERS (smollm2: GRPO steps a run),
# EXTRA (flags added to every run, e.g. EXTRA="--train-iters 3 --warmup-iters 5" to try the script),
# LR (seeded runs: this lr for every row instead of the search's best, e.g. to repeat an earlier table).
#
# Runs go one after another; two invocations on the same OUT share its runs (below). A run
# whose summary.json exists is skipped, and an interrupted run
# resumes from its last checkpoint (every run saves every SAVE_INTERVAL steps into its own
# folder; a SIGTERM or SIGUSR1 saves the step in flight), so re-running the same command
# finishes what is left. Each run writes OUT/<row>_s<seed>/ (search: OUT/lr_search/<row>_lr<lr>_s<seed>/)
# {summary.json,metrics.jsonl,log.txt}; tools/plot_parity.py tabulates and plots them and
# prints each row's best lr (--best-lr ROW), which the seeded runs read.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
source launch/python_env.sh  # PYTHON, else .venv when it exists, else python3
usage="usage: parity_runs.sh smollm2|tiny OUT search | parity_runs.sh smollm2|tiny OUT [SEEDS...]"
kind=${1:?$usage}
out=${2:?$usage}
shift 2
mode=seeds
if [ "${1:-}" = search ]; then mode=search; shift; fi
mkdir -p "$out"
rows=${ROWS:-"logra adam-kl adam"}
target=0.01  # the controlled rows' KL target (the trainer's default)

case $kind in
  smollm2)
    default_seeds="1 2 3"
    lrs=${LRS:-"1e-5 3e-5 1e-4"}
    search_seed=${SEARCH_SEED:-7}
    save_interval=${SAVE_INTERVAL:-4}
    models=$out/models
    # The only pretrained model that installs offline, exported and converted as docs/OPTIMIZER.md shows.
    if [ ! -f "$models/smollm2-mc/model_config.json" ]; then
      "$PYTHON" tools/export_smollm2.py --out "$models/smollm2-hf" --dtype fp32
      "$PYTHON" tools/convert_hf_to_mcore.py --hf-dir "$models/smollm2-hf" --save "$models/smollm2-mc"
    fi
    # chain_sum with two 1-2 digit terms: SmolLM2-135M-Instruct answers ~28% of the held-out
    # problems greedily, so RL has reward to work with and room to grow. The chat template and
    # the \boxed{} instruction are on (auto: the converted checkpoint carries them). 200
    # held-out problems: a Wilson half-width of about 7 points at 30-50%.
    common=(--task chain_sum --task-options '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
            --warmup-iters 0 --train-iters "${ITERS:-8}" --prompts-per-step 4 --group-size 8 --max-new-tokens 32
            --temperature 0.7 --micro-batch-size 8 --eval-prompts 200 --keep-checkpoints 1 --no-progress
            --log-interval 1)
    ;;
  tiny)
    default_seeds="1234 1235 1236 1237 1238"
    lrs=${LRS:-"1e-4 3e-4 1e-3"}
    search_seed=${SEARCH_SEED:-1239}
    save_interval=${SAVE_INTERVAL:-50}
    common=(--no-progress --log-interval 50)
    ;;
  *) echo "error: unknown run kind '$kind' (smollm2 or tiny)" >&2; exit 2 ;;
esac

control=(--kl-control probe --kl-target "$target" --kl-max-scale 1 --kl-probe-sequences 8)
declare -A row_flags=(
  [logra]="--optimizer logra ${control[*]}"
  [adam-kl]="--optimizer adam ${control[*]}"
  [adam]="--optimizer adam --kl-control off"
  [logra-decay]="--optimizer logra ${control[*]} --kl-target-final 0.001 --kl-target-schedule cosine"
  [bf16-fp32]="--bf16 --logra-master fp32"
  [bf16-sr]="--bf16 --logra-master bf16-sr"
)
for row in $rows; do
  [ -n "${row_flags[$row]:-}" ] || { echo "error: unknown row '$row' in ROWS (${!row_flags[*]})" >&2; exit 2; }
done
read -r -a extra <<< "${EXTRA:-}"
# A signal to this script is passed on to the run in flight (which saves the step it is in and
# exits; it ignores a second copy, as when SLURM signals every process of the job step), and the
# script ends after it.
stop=0
child=
trap 'stop=1; [ -z "$child" ] || kill -TERM "$child" 2> /dev/null || true' TERM
trap 'stop=1; [ -z "$child" ] || kill -USR1 "$child" 2> /dev/null || true' USR1

# tiny: the RL rows start from one warmed-up checkpoint per seed (the main job's supervised
# warm-up, with its LoGRA optimizer, saved by --train-iters 0), each loading its weights with
# --no-load-optim, so that every row's RL starts from the same weights and held-out accuracy.
# (With its own optimizer's warm-up, dense Adam started RL at 8.7% where LoGRA started at 34.7%
# on the same seed: docs/results/runs/tiny_fair.) The bf16 rows are the whole main job, warm-up
# included. SmolLM2 has no warm-up (RL from the pretrained model).
shared_start_rows=
[ "$kind" = tiny ] && shared_start_rows="logra adam-kl adam logra-decay"
# Two invocations on the same OUT share the work (e.g. one per core, OMP_NUM_THREADS=1): each
# run's folder is claimed by the invocation that runs it (claimed_by: its pid), and the other
# skips a run claimed by a live invocation (a claim whose process is gone is taken over).
claim() {  # claim DIR: succeeds, and holds DIR, unless another live invocation holds it
  local holder
  holder=$(cat "$1/claimed_by" 2> /dev/null || true)
  if [ -n "$holder" ] && [ "$holder" != "$$" ] && kill -0 "$holder" 2> /dev/null; then return 1; fi
  echo "$$" > "$1/claimed_by"
}

warm_start() {  # warm_start SEED: OUT/warm_s<SEED>/ckpt, made once
  local dir=$out/warm_s$1
  mkdir -p "$dir"
  until claim "$dir"; do sleep 10; done  # (another invocation is making it: wait for it)
  if [ -f "$dir/summary.json" ]; then rm -f "$dir/claimed_by"; return 0; fi
  echo "$(date -u +%FT%TZ) start $kind warm-up seed $1" | tee -a "$out/progress.log"
  "$PYTHON" -m logra_megatron.train "${common[@]}" "${extra[@]}" --train-iters 0 --seed "$1" --output-dir "$dir" \
    --save "$dir/ckpt" >> "$dir/log.txt" 2>&1 || {
    echo "error: the warm-up of seed $1 failed (see $dir/log.txt)" >&2; exit 1; }
  rm -f "$dir/claimed_by"
}

run_one() {  # run_one DIR ROW SEED LR: one run, resumable, skipped when finished
  local dir=$1 row=$2 seed=$3 lr=$4
  [ -f "$dir/summary.json" ] && return 0
  mkdir -p "$dir"
  if ! claim "$dir"; then
    echo "$(date -u +%FT%TZ) skip $kind $row seed $seed lr $lr: another invocation runs it" | tee -a "$out/progress.log"
    return 0
  fi
  local flags
  read -r -a flags <<< "${row_flags[$row]}"
  flags=("${common[@]}" "${flags[@]}" --seed "$seed" --lr "$lr" --output-dir "$dir"
         --save "$dir/ckpt" --save-interval "$save_interval" --keep-checkpoints 1 "${extra[@]}")
  if [ -f "$dir/ckpt/latest_checkpointed_iteration.txt" ]; then
    flags+=(--load "$dir/ckpt")
  elif [ "$kind" = smollm2 ]; then
    flags+=(--load "$models/smollm2-mc")
  elif [[ " $shared_start_rows " == *" $row "* ]]; then
    warm_start "$seed"
    flags+=(--load "$out/warm_s$seed/ckpt" --no-load-optim)
  fi
  echo "$(date -u +%FT%TZ) start $kind $row seed $seed lr $lr" | tee -a "$out/progress.log"
  # In the background and waited for, so that a signal to this script runs its trap at once.
  "$PYTHON" -m logra_megatron.train "${flags[@]}" >> "$dir/log.txt" 2>&1 &
  child=$!
  wait "$child" || true
  while kill -0 "$child" 2> /dev/null; do wait "$child" || true; done  # (a trap interrupted the wait)
  child=
  # What happened is in the summary: none (failed), finished, or stopped early (preempted).
  if [ ! -f "$dir/summary.json" ]; then
    local what="FAILED"
    [ "$stop" = 1 ] && what="stopped by a signal"
    echo "$(date -u +%FT%TZ) $what: $kind $row seed $seed lr $lr (see $dir/log.txt)" | tee -a "$out/progress.log"
  elif grep -q '"finished": true' "$dir/summary.json"; then
    rm -rf "$dir/ckpt"  # complete: its summary and metrics are what is kept
    echo "$(date -u +%FT%TZ) end $kind $row seed $seed lr $lr" | tee -a "$out/progress.log"
  else  # preempted (SIGTERM/SIGUSR1): the checkpoint stays and the next call resumes it
    rm -f "$dir/summary.json"
    echo "$(date -u +%FT%TZ) stopped $kind $row seed $seed lr $lr (resumes on the next call)" | tee -a "$out/progress.log"
    stop=1
  fi
  rm -f "$dir/claimed_by"
  if [ "$stop" = 1 ]; then exit 0; fi
}

if [ "$mode" = search ]; then
  for lr in $lrs; do
    for row in $rows; do
      run_one "$out/lr_search/${row}_lr${lr}_s${search_seed}" "$row" "$search_seed" "$lr"
    done
  done
  "$PYTHON" tools/plot_parity.py --runs "$out" --name "${kind}_lr_search" --out-dir "$out"
  exit 0
fi

seeds=${*:-$default_seeds}
declare -A best
for row in $rows; do
  if [ -n "${LR:-}" ]; then best[$row]=$LR; continue; fi
  best[$row]=$("$PYTHON" tools/plot_parity.py --runs "$out" --best-lr "$row") || {
    echo "error: no finished learning-rate search for $row: run 'bash launch/parity_runs.sh $kind $out search' first" >&2
    exit 2; }
  echo "$(date -u +%FT%TZ) $row: best lr ${best[$row]} (the search's)" | tee -a "$out/progress.log"
done
for seed in $seeds; do
  for row in $rows; do
    run_one "$out/${row}_s$seed" "$row" "$seed" "${best[$row]}"
  done
done
