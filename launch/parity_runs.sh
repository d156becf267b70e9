#!/usr/bin/env bash
# Dense Adam vs LoGRA parity runs (docs/results/README.md lists what they produced).
#
#   bash launch/parity_runs.sh smollm2 OUT [SEEDS...]   SmolLM2-135M-Instruct on reasoning-gym chain_sum
#   bash launch/parity_runs.sh tiny OUT [SEEDS...]      the embedded default job
#
# Runs one after another, LoGRA and dense alternating per seed. A run whose summary.json exists
# is skipped, and a SmolLM2 run that was interrupted resumes from its last checkpoint, so
# re-running the same command finishes what is left. Each run writes OUT/<optimizer>_s<seed>/
# {summary.json,metrics.jsonl,log.txt}; tools/plot_parity.py tabulates and plots them.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: parity_runs.sh smollm2|tiny OUT [SEEDS...]}
out=${2:?usage: parity_runs.sh smollm2|tiny OUT [SEEDS...]}
shift 2
mkdir -p "$out"

case $kind in
  smollm2)
    seeds=${*:-"1 2"}
    models=$out/models
    # The only pretrained model that installs offline, exported and converted as README.md shows.
    if [ ! -f "$models/smollm2-mc/model_config.json" ]; then
      python tools/export_smollm2.py --out "$models/smollm2-hf" --dtype fp32
      python tools/convert_hf_to_mcore.py --hf-dir "$models/smollm2-hf" --save "$models/smollm2-mc"
    fi
    # chain_sum with two 1-2 digit terms: SmolLM2-135M-Instruct answers ~28% of the held-out
    # problems greedily, so RL has reward to work with and room to grow. The chat template and
    # the \boxed{} instruction are on (auto: the converted checkpoint carries them).
    common=(--task chain_sum --task-options '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
            --warmup-iters 0 --train-iters 8 --prompts-per-step 4 --group-size 8 --max-new-tokens 32 --temperature 0.7
            --micro-batch-size 8 --eval-prompts 64 --lr 3e-5
            --save-interval 4 --keep-checkpoints 1 --no-progress --log-interval 1)
    ;;
  tiny)
    seeds=${*:-"1234 1235 1236 1237 1238"}
    common=(--no-progress --log-interval 50)
    ;;
  *) echo "error: unknown run kind '$kind' (smollm2 or tiny)" >&2; exit 2 ;;
esac

for seed in $seeds; do
  for optimizer in logra adam; do
    dir=$out/${optimizer}_s$seed
    [ -f "$dir/summary.json" ] && continue
    mkdir -p "$dir"
    flags=("${common[@]}" --seed "$seed" --optimizer "$optimizer" --output-dir "$dir")
    # Dense Adam runs as users run it (no step control); LoGRA with its defaults (rank 0.5,
    # KL control by probe).
    [ "$optimizer" = adam ] && flags+=(--kl-control off)
    if [ "$kind" = smollm2 ]; then
      if [ -f "$dir/ckpt/latest_checkpointed_iteration.txt" ]; then load=$dir/ckpt; else load=$models/smollm2-mc; fi
      flags+=(--load "$load" --save "$dir/ckpt")
    fi
    echo "$(date -u +%FT%TZ) start $kind $optimizer seed $seed" | tee -a "$out/progress.log"
    python -m logra_megatron.train "${flags[@]}" > "$dir/log.txt" 2>&1 || {
      echo "$(date -u +%FT%TZ) FAILED $kind $optimizer seed $seed (see $dir/log.txt)" | tee -a "$out/progress.log"; continue; }
    rm -rf "$dir/ckpt"  # the run is complete: its summary and metrics are what is kept
    echo "$(date -u +%FT%TZ) end $kind $optimizer seed $seed" | tee -a "$out/progress.log"
  done
done
