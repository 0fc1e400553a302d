#!/usr/bin/env bash
# The measured GPU run of RESULTS.md on the SmolLM2-135M-Instruct testbed (one H200), and the GPU benchmarks.
#
#   python bench/testbed_data.py --out .cache/gpu --sharegpt 8192 --split 2     # where the testbed packages are
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash bench/gpu_testbed_run.sh
#
# Every step is a dflashkit command (or a bench script) run as a user would; each one's log, exit status and
# wall time go to $RUN (stages.txt). Evaluation is Python-bound at this model size (the GPU idles between
# ~25 ms eager steps), so the chain and tree evaluations of both datasets run as 8 processes side by side on
# the one GPU: tau does not depend on timing; their speed numbers are measured under that sharing and are
# reported as such. The AR baseline runs on the first BASELINE prompts of each part.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
PROMPTS=${PROMPTS:-6144}
EPOCHS=${EPOCHS:-3}
BASELINE=${BASELINE:-4}
LOSS=${LOSS:-dpace}
NEW=${NEW:-384}                  # regenerated tokens per answer
EVAL_PROMPTS=${EVAL_PROMPTS:-1000}
EVAL_NEW=${EVAL_NEW:-256}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$R"
dk=(python -m dflashkit)

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, record rc and wall time
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  echo "[$(date +%T)] $name: $*" | tee -a "$R/stages.txt"
  timeout -s INT "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name: rc=$rc $(( $(date +%s) - start )) s" | tee -a "$R/stages.txt"
}

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stage bench-extract-smollm2 240 python bench/bench_extract.py --target "$T" --json "$R/bench_extract_smollm2.json"
  stage bench-extract-qwen3-8b 300 python bench/bench_extract.py --random-qwen3-8b --layer-ids 1 9 17 25 33 \
    --batch 8 --seq 2048 --json "$R/bench_extract_qwen3_8b.json"
fi

stage regenerate 420 "${dk[@]}" regenerate --target "$T" --data "$D/sharegpt.jsonl" --limit "$PROMPTS" --out "$R/regen.jsonl" \
  --resume --max-new-tokens "$NEW" --batch-size 512 --max-prompt-length 512 --max-turns 1 --device "$DEVICE" --dtype "$DTYPE"
stage extract 420 "${dk[@]}" extract --target "$T" --data "$R/regen.jsonl" --out "$R/shards" --num-taps 5 --max-length 1024 \
  --resume --device "$DEVICE" --dtype "$DTYPE" $([ "$LOSS" = kl ] && echo --store-last-hidden)
stage train 600 "${dk[@]}" train --recipe recipes/smollm2-135m.yaml --shards "$R/shards" --output-dir "$R/train-$LOSS" \
  --loss "$LOSS" "export_dir=$R/drafter-$LOSS" mask_token_id=16 max_length=1024 "target=$T" wandb=false \
  "epochs=$EPOCHS" eval_samples=${EVAL_SAMPLES:-64} ${TRAIN_EXTRA:-}

[ -f "$R/drafter-$LOSS/config.json" ] || { echo "no drafter was exported: see $R/train.log" | tee -a "$R/stages.txt"; exit 1; }
echo "[$(date +%T)] eval: 8 processes" | tee -a "$R/stages.txt"
start=$(date +%s)
for mode in chain tree; do
  for part in mtbench.part0 mtbench.part1 humaneval.part0 humaneval.part1; do
    timeout -s INT 900 python -m dflashkit eval --target "$T" --drafter "$R/drafter-$LOSS" --dataset "$D/$part.jsonl" \
      --num-prompts "$EVAL_PROMPTS" --baseline-prompts "$BASELINE" --max-new-tokens "$EVAL_NEW" --mode "$mode" \
      --tree-budget 64 --device "$DEVICE" --dtype "$DTYPE" --out "$R/eval-$LOSS-$mode-$part" > "$R/eval-$LOSS-$mode-$part.log" 2>&1 &
  done
done
wait
echo "[$(date +%T)] eval: done $(( $(date +%s) - start )) s" | tee -a "$R/stages.txt"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stage bench-tree-attention 300 python bench/bench_tree_attention.py --no-flex --out "$R/bench_tree_attention.json"
fi
echo "[$(date +%T)] all done" | tee -a "$R/stages.txt"
