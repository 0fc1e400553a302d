#!/usr/bin/env bash
# The testbed run of RESULTS.md on two H200s (one works too, more slowly): regenerate every ShareGPT user turn
# with the SmolLM2-135M target, train the 5-layer drafter online, evaluate chain and tree on MT-bench 80 and
# HumanEval 164; meanwhile the second GPU runs the GPU benchmarks, then the data-size and loss comparisons.
#
#   python bench/testbed_data.py --out .cache/gpu --sharegpt 0          # where the testbed packages are installed
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash bench/testbed_tau_run.sh
#   SCALE=toy TARGET=testbed:smollm2 DEVICE=cpu bash bench/testbed_tau_run.sh        # the same stages, tiny, CPU
#
# Every step is a dflashkit command or a bench script, run as a user would, under a time limit (SIGINT: training
# then writes a checkpoint at the current step and exits 0, eval writes a partial report). Each stage's log, exit
# status and wall time go to $RUN/stages.txt.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-full}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$R"
dk=(python -m dflashkit)
if [ "$SCALE" = toy ]; then   # minutes on a CPU: a check that every stage runs, not a measurement
  LIMIT_CONV=12; NEW=24; BATCH=8; EPOCHS=1; EVAL_PROMPTS=2; EVAL_NEW=16; FIRST="6 12"; SMALL=first12; MAXLEN=256
  TRAIN_EXTRA=(num_hidden_layers=1 num_anchors=16 mixed_precision=no compile=false micro_batch_tokens=512
               eval_samples=2 save_every=0)
  DT=float32; L_REGEN=600; L_TRAIN=600; L_SMALL=600; L_EVAL=600; L_EVAL_SMALL=600; BENCH=0
else
  LIMIT_CONV=0; NEW=256; BATCH=1024; EPOCHS=3; EVAL_PROMPTS=164; EVAL_NEW=256; FIRST="5000 11146"; SMALL=first11146
  MAXLEN=1024
  TRAIN_EXTRA=(micro_batch_tokens=16384 grad_accum=1 eval_samples=64 eval_every=0 save_every=200 compile=true)
  DT=bfloat16; L_REGEN=${L_REGEN:-330}; L_TRAIN=${L_TRAIN:-420}; L_SMALL=${L_SMALL:-130}; L_EVAL=${L_EVAL:-330}
  L_EVAL_SMALL=${L_EVAL_SMALL:-100}; BENCH=${BENCH:-1}
fi
NGPU=$([ "$DEVICE" = cuda ] && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
G0=0; G1=$([ "$NGPU" -ge 2 ] && echo 1 || echo 0)

stage() {  # stage NAME GPU SECONDS COMMAND...: run with a time limit on one GPU, log, record rc and wall time
  local name=$1 gpu=$2 limit=$3; shift 3
  local start; start=$(date +%s)
  echo "[$(date +%T)] $name (gpu $gpu): $*" >> "$R/stages.txt"
  CUDA_VISIBLE_DEVICES=$gpu timeout -s INT -k 30 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name: rc=$rc $(( $(date +%s) - start )) s" >> "$R/stages.txt"
  return $rc
}

train_and_export() {  # NAME GPU LIMIT DATA LOSS: online training, then an export of whatever step it reached
  local name=$1 gpu=$2 limit=$3 data=$4 loss=$5
  stage "train-$name" "$gpu" "$limit" "${dk[@]}" train --recipe recipes/smollm2-135m.yaml --target "$T" \
    --data "$data" --output-dir "$R/train-$name" --loss "$loss" "export_dir=$R/drafter-$name" \
    "max_length=$MAXLEN" "epochs=$EPOCHS" wandb=false progress=false "${TRAIN_EXTRA[@]}"
  if [ ! -f "$R/drafter-$name/config.json" ]; then  # stopped by its time limit: export its last checkpoint
    local last; last=$(ls -d "$R/train-$name"/checkpoints/step-* 2>/dev/null | sort | tail -1)
    [ -n "$last" ] && stage "export-$name" "$gpu" 120 python -m dflashkit.train.export "$last" "$R/drafter-$name"
  fi
}

eval_chain_mtbench() {  # NAME GPU: live chain tau on MT-bench (the data-size and loss comparisons)
  [ -f "$R/drafter-$1/config.json" ] || return 1
  stage "eval-$1" "$2" "$L_EVAL_SMALL" "${dk[@]}" eval --target "$T" --drafter "$R/drafter-$1" \
    --dataset "$D/mtbench.jsonl" --num-prompts "$EVAL_PROMPTS" --mode chain --max-new-tokens "$EVAL_NEW" \
    --baseline-prompts 8 --reference-prompts 2 --device "$DEVICE" --dtype "$DT" --out "$R/eval-$1"
}

# --- GPU 0: regenerate every user turn, then the main drafter (all turns), then its evaluation ---------------
main_line() {
  stage regenerate "$G0" "$L_REGEN" "${dk[@]}" regenerate --target "$T" --data "$D/sharegpt_turns.jsonl" \
    --out "$R/regen.jsonl" --resume --max-new-tokens "$NEW" --batch-size "$BATCH" --max-prompt-length 1024 \
    $([ "$LIMIT_CONV" -gt 0 ] && echo --limit "$LIMIT_CONV") --dtype "$DT" --no-progress \
    $([ "$DEVICE" = cpu ] && echo --device cpu)
  stage subsets "$G0" 120 python bench/testbed_subsets.py --regen "$R/regen.jsonl" --out "$R/data" --first $FIRST
  touch "$R/data.ready"
  train_and_export all "$G0" "$L_TRAIN" "$R/data/all.jsonl" dpace
  [ -f "$R/drafter-all/config.json" ] && stage eval-all "$G0" "$L_EVAL" python bench/bench_eval.py --target "$T" \
    --drafter "$R/drafter-all" --dataset "$D/mtbench.jsonl" "$D/humaneval.jsonl" --num-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$EVAL_NEW" --modes chain tree --tree-budget 64 --baseline-prompts 10 --reference-prompts 8 \
    --dtype "$DT" --out "$R/bench_eval.json"
}

# --- GPU 1: the benchmarks, then equal-data comparisons: dpace vs ce, and a smaller data point -------------------
side_line() {
  if [ "$BENCH" = 1 ]; then
    stage bench-train-testbed "$G1" 150 python bench/bench_train_throughput.py --target "$T" \
      --out "$R/train_throughput_smollm2.json"
    stage bench-regenerate "$G1" 180 python bench/bench_regenerate.py --target "$T" --data "$D/sharegpt.jsonl" \
      --prompts 2048 --max-new-tokens 384 --batch 512 --hf-prompts 512 --out "$R/regenerate_h200.json"
    stage bench-extract-testbed "$G1" 100 python bench/bench_extract.py --target "$T" --batches 8 --repeats 3 \
      --out-dir "$R/bench-extract-tmp" --out "$R/extract_smollm2.json"
    stage bench-extract-qwen3-8b "$G1" 150 python bench/bench_extract.py --random-qwen3-8b --layer-ids 1 9 17 25 33 \
      --batch 8 --seq 2048 --batches 8 --repeats 3 --out-dir "$R/bench-extract-tmp" --out "$R/extract_qwen3_8b.json"
    rm -rf "$R/bench-extract-tmp"
    stage bench-verify-step "$G1" 90 python bench/bench_verify_step.py --target "$T" --prefix 512 1024 \
      --nodes 16 64 --out "$R/verify_step_testbed.json"
    stage bench-train-qwen3-8b "$G1" 150 python bench/bench_train_throughput.py --qwen3-8b \
      --out "$R/train_throughput_qwen3_8b.json"
  fi
  while [ ! -f "$R/data.ready" ]; do sleep 5; done
  for loss in dpace ce; do
    train_and_export "$SMALL-$loss" "$G1" "$L_SMALL" "$R/data/$SMALL.jsonl" "$loss"
    eval_chain_mtbench "$SMALL-$loss" "$G1"
  done
}

echo "[$(date +%T)] start: $NGPU GPU(s), scale $SCALE" >> "$R/stages.txt"
main_line &
side_line &
wait
echo "[$(date +%T)] all done" >> "$R/stages.txt"
