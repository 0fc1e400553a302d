#!/usr/bin/env bash
# One H200 session for the DFlash2 comparison, the recipe screen and the engine in the loop (RESULTS.md,
# BENCHMARKS.md "vLLM in the loop"):
#   0. vLLM alone on the GPU: the step times of a random Qwen3-8B-shaped target with and without a 5-layer drafter
#      of its dims (bench/bench_vllm.py --parts projection; no trained drafter needed);
#   1. the first user turn of every testbed ShareGPT conversation answered by the target (256 new tokens);
#   2. side by side on the one GPU (tau does not depend on timing; wall times of runs that share a GPU are not
#      solo times): DFlash and DFlash2 trained online for EPOCHS epochs with the same recipe otherwise, and recipe
#      variants screened at SCREEN_EPOCHS epochs (bench/recipe_study.py); each export evaluated live, chain, greedy,
#      256 new tokens: MT-bench 80 (and HumanEval 164 for DFlash / DFlash2);
#   3. vLLM alone on the GPU again, with the DFlash drafter of step 2: tau from vLLM's counters against the
#      `dflashkit eval` report of the same prompts, greedy agreement with and without the drafter, the concurrency
#      table, prefix cache on and off (bench/bench_vllm.py --parts serve), then the 8B projection of step 0 from
#      the measured per-position acceptance.
#
#   python bench/testbed_data.py --out .cache/gpu --sharegpt 0        # here, where the testbed packages are
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash bench/testbed_engine_run.sh   # H200
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash bench/testbed_engine_run.sh                                                             # CPU twin
#
# The toy scale runs every stage on the CPU in minutes (vLLM replaced by its CPU stand-in, eval/vllm_standin.py):
# a check that the stages fit together, not a measurement. vLLM must run alone on the GPU (its start-up memory
# profiling asserts that no other process frees memory meanwhile), so steps 0 and 3 never overlap the others.
# Each stage's log, exit status and wall time go to $RUN/stages.txt; results to $RUN/out/.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
EPOCHS=${EPOCHS:-3}
SCREEN_EPOCHS=${SCREEN_EPOCHS:-1}
# recipe variants screened beside the two architectures (names of "$ROOT/bench/recipe_study.py" VARIANTS)
SCREEN=${SCREEN:-default,muon,tokens_8k,lr_1e3}
O=$R/out
mkdir -p "$R" "$O"
# every command runs from the run directory, with the scripts by absolute path: `python -m dflashkit...` from the
# checkout's root would import its dflashkit/ folder (the command and version only) where dflashkit is not
# installed but put on PYTHONPATH (bench/import_path.sh)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
D=$(cd "$D" && pwd)
R=$(cd "$R" && pwd)
O=$R/out
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
cd "$R" || exit 1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$SCALE" = toy ]; then
  DEV=(--device cpu); SLOTS=8; NEW=16; LIMIT=(--limit 24); EVAL=(--num-prompts 2 --max-new-tokens 16)
  EXTRA=max_steps=3,num_hidden_layers=1,compile=false,mixed_precision=no,micro_batch_tokens=1024,num_anchors=8,eval_samples=2,max_length=256
  VLLM=(--standin --num-prompts 2 --max-new-tokens 8 --concurrency 1 2 --max-requests-per-level 2)
  PROJ=(--standin --concurrency 1 2 --projection-new-tokens 8); L_TRAIN=900; L_SCREEN=900; L_EVAL=600
  HE=""
else
  DEV=(); SLOTS=2048; NEW=256; LIMIT=(); EVAL=(--num-prompts 200 --max-new-tokens 256)
  EXTRA=max_length=2048,eval_samples=64,eval_every=0,save_every=200,keep_last=2,tokenize_workers=4
  VLLM=(--num-prompts 80 --max-new-tokens 256); PROJ=(--concurrency 1 4 16 64); L_TRAIN=${L_TRAIN:-900}; L_SCREEN=${L_SCREEN:-600}
  L_EVAL=${L_EVAL:-240}; HE="$D/humaneval.jsonl"
fi

stage() {  # stage NAME SECONDS COMMAND...: run under a time limit (SIGINT first), log, record rc and wall time
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  echo "[$(date +%T)] $name: $*" >> "$R/stages.txt"
  timeout -s INT -k 60 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name: rc=$rc $(( $(date +%s) - start )) s" >> "$R/stages.txt"
  cp "$R/$name.log" "$O/$name.log" 2>/dev/null
  return $rc
}
VENV=(bash "$ROOT/bench/vllm_env.sh" "$PY")  # the slim vLLM's environment (../shared/vllm/README.md)
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

# --- 0. vLLM alone: the 8B-shaped step times (the projection's measured half) ------------------------------------
[ -z "${SKIP_VLLM:-}" ] && \
  stage vllm-projection 420 "${VENV[@]}" "$ROOT/bench/bench_vllm.py" --parts projection --out "$O/vllm" "${PROJ[@]}"

# --- 1. the first user turn of every conversation answered by the target -------------------------------------------
if [ ! -s "$R/regen.jsonl" ]; then
  [ -f "$D/sharegpt.jsonl" ] || gunzip -k "$D/sharegpt.jsonl.gz"
  stage regenerate 420 "$PY" -m dflashkit.extract.regenerate --target "$T" --data "$D/sharegpt.jsonl" \
    --out "$R/regen.jsonl" --max-turns 1 --max-new-tokens "$NEW" --batch-size "$SLOTS" --max-prompt-length 1024 \
    --no-progress "${DEV[@]}" "${LIMIT[@]}"
fi
echo "regenerated conversations: $(wc -l < "$R/regen.jsonl")" >> "$R/stages.txt"

# --- 2. DFlash vs DFlash2 (EPOCHS) beside the recipe screen (SCREEN_EPOCHS), all at once ------------------------
study() {  # NAME EPOCHS LIMIT VARIANTS DATASETS...
  local name=$1 epochs=$2 limit=$3 variants=$4; shift 4
  stage "study-$name" $(( limit + L_EVAL + 300 )) "$PY" "$ROOT/bench/recipe_study.py" --target "$T" --data "$R/regen.jsonl" \
    --out "$O/$name" --work-dir "$R/work-$name" --variants "$variants" --epochs "$epochs" --parallel 8 \
    --train-time-limit "$limit" --eval-time-limit "$L_EVAL" --extra-overrides "$EXTRA" --dataset "$@" \
    "${EVAL[@]}" "${DEV[@]}"
}
study arch "$EPOCHS" "$L_TRAIN" default,dflash2 "$D/mtbench.jsonl" $HE &
study screen "$SCREEN_EPOCHS" "$L_SCREEN" "$SCREEN" "$D/mtbench.jsonl" &
wait

# --- 3. vLLM alone: the DFlash drafter served, against its own dflashkit report -------------------------------------
DRAFTER=$R/work-arch/train/default/export
REPORT=$O/arch/results/default/report.json
if [ -f "$DRAFTER/config.json" ]; then
  if [ "$SCALE" = toy ]; then
    stage vllm-serve 600 "$PY" "$ROOT/bench/bench_vllm.py" --parts serve projection --out "$O/vllm" "${VLLM[@]}" \
      --projection-new-tokens 8
  else
    stage vllm-serve 540 "${VENV[@]}" "$ROOT/bench/bench_vllm.py" --parts serve --target "$T" --drafter "$DRAFTER" \
      --dflashkit-report "$REPORT" --dataset "$D/mtbench.jsonl" --out "$O/vllm" "${VLLM[@]}"
    stage vllm-projection-model 120 "$PY" "$ROOT/bench/bench_vllm.py" --parts projection_model --out "$O/vllm"
    # last: `dflashkit eval --server` against a real `vllm serve` on loopback (needs uvicorn beside the slim vLLM)
    [ -z "${SKIP_SERVER:-}" ] && stage vllm-server 300 "${VENV[@]}" "$ROOT/bench/bench_vllm.py" --parts server \
      --target "$T" --drafter "$DRAFTER" --dataset "$D/mtbench.jsonl" --num-prompts 32 --out "$O/vllm"
  fi
fi
echo "[$(date +%T)] all done" >> "$R/stages.txt"
