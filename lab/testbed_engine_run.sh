#!/usr/bin/env bash
# One H200 session for DFlash vs DFlash2 at equal data and the engine in the loop (lab/NOTEBOOK.md, lab/BENCHMARKS.md
# "vLLM in the loop"). Stages, in order (a stage's results are in $RUN/out as soon as it ends):
#   1. the first user turn of every testbed ShareGPT conversation answered by the target (256 new tokens);
#   2. DFlash trained online for EPOCHS epochs, alone on the GPU (lab/recipe_study.py --stage train);
#   3. vLLM alone on the GPU with that drafter: tau from vLLM's counters, greedy agreement with and without the
#      drafter, the concurrency table, prefix cache on and off (bench/bench_vllm.py --parts serve);
#   4. DFlash2 trained with the same recipe otherwise, beside the live eval of the DFlash export (chain, greedy,
#      bf16, 256 new tokens, MT-bench 80 and HumanEval 164; tau does not depend on timing, but DFlash2's tokens/s
#      were measured with that eval beside it); 5. the DFlash2 export evaluated the same way;
#   6. tau in vLLM against tau in `dflashkit eval` on the same prompts, then the 8B projection from vLLM's measured
#      per-position acceptance (the 8B step times: PROJECTION=1 measures them first, stage 0, vLLM alone);
#   7. last, `dflashkit eval --server` against a real `vllm serve` on loopback (SKIP_SERVER=1 skips it).
#
#   python -m lab.testbed_data --out .cache/gpu --sharegpt 0        # here, where the testbed packages are
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash lab/testbed_engine_run.sh   # H200
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash lab/testbed_engine_run.sh                                                             # CPU twin
#
# The toy scale runs every stage on the CPU in minutes (vLLM replaced by its CPU stand-in, lab/standin_bench_vllm.py):
# a check that the stages fit together, not a measurement. vLLM must run alone on the GPU (its start-up memory
# profiling asserts that no other process frees memory meanwhile), so its stages wait for the GPU to be idle.
# Each stage's log, exit status and wall time go to $RUN/stages.txt; results to $RUN/out/.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
EPOCHS=${EPOCHS:-3}
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; stage()
if [ "$SCALE" = toy ]; then
  DEV=(--device cpu); SLOTS=8; NEW=8; LIMIT=(--limit 24); EVAL=(--num-prompts 1 --max-new-tokens 8)
  EXTRA=max_steps=2,num_hidden_layers=1,block_size=4,compile=false,mixed_precision=no,micro_batch_tokens=256,num_anchors=8,eval_samples=2,eval_anchors=4,max_length=256
  VLLM=(--num-prompts 2 --max-new-tokens 8 --concurrency 1 2 --max-requests-per-level 2)
  PROJ=(--concurrency 1 2 --projection-new-tokens 8); L_TRAIN=${L_TRAIN:-900}; L_TRAIN2=${L_TRAIN2:-900}
  L_EVAL=${L_EVAL:-600}
else
  DEV=(); SLOTS=2048; NEW=256; LIMIT=(); EVAL=(--num-prompts 200 --max-new-tokens 256)
  EXTRA=max_length=2048,eval_samples=64,eval_every=0,save_every=200,keep_last=2,tokenize_workers=4
  VLLM=(--num-prompts 80 --max-new-tokens 256 --concurrency 1 2 4 8 16 32 64 128 --max-requests-per-level 32)
  PROJ=(--concurrency 1 4 16 64); L_TRAIN=${L_TRAIN:-480}; L_TRAIN2=${L_TRAIN2:-480}; L_EVAL=${L_EVAL:-300}
fi
HE="$D/humaneval.jsonl"

VENV=(bash "$ROOT/lab/vllm_env.sh" "$PY")  # the slim vLLM's environment (../shared/vllm/README.md)
gpu_idle() {  # until no process computes on the GPU (at most 120 s): vLLM's start-up profiling must run alone
  command -v nvidia-smi > /dev/null || return 0
  local k
  for k in $(seq 120); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "[$(date +%T)] the GPU is still busy after 120 s" >> "$R/stages.txt"
}
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

# --- 0. (PROJECTION=1) vLLM alone: the 8B-shaped step times (the projection's measured half) ----------------------
[ -n "${PROJECTION:-}" ] && [ "$SCALE" != toy ] && \
  stage vllm-projection 420 "${VENV[@]}" -m bench.bench_vllm --parts projection --out "$O/vllm" "${PROJ[@]}"

# --- 1. the first user turn of every conversation answered by the target -------------------------------------------
first_turns

study() {  # NAME STAGE LIMIT VARIANT: one architecture's run of lab/recipe_study.py (its own OUT and work dir)
  local name=$1 what=$2 limit=$3 variant=$4
  stage "$what-$name" $(( limit + L_EVAL + 300 )) "$PY" -m lab.recipe_study --target "$T" \
    --data "$R/regen.jsonl" --out "$O/$name" --work-dir "$R/work-$name" --variants "$variant" --epochs "$EPOCHS" \
    --stage "$what" --train-time-limit "$limit" --eval-time-limit "$L_EVAL" --extra-overrides "$EXTRA" \
    --dataset "$D/mtbench.jsonl" "$HE" "${EVAL[@]}" "${DEV[@]}"
}
DRAFTER=$R/work-dflash/train/default/export
REPORT=$R/work-dflash/eval/default/report.json

# --- 2. DFlash, alone -------------------------------------------------------------------------------------------
study dflash train "$L_TRAIN" default

# --- 3. vLLM alone: the DFlash drafter served --------------------------------------------------------------------
if [ "$SCALE" = toy ]; then
  stage vllm-serve 600 "$PY" -m lab.standin_bench_vllm --parts serve projection --out "$O/vllm" "${VLLM[@]}" \
    --projection-new-tokens 8
elif [ -f "$DRAFTER/config.json" ]; then
  gpu_idle
  stage vllm-serve 480 "${VENV[@]}" -m bench.bench_vllm --parts serve --target "$T" --drafter "$DRAFTER" \
    --dataset "$D/mtbench.jsonl" --out "$O/vllm" "${VLLM[@]}"
fi

# --- 4. DFlash2 beside the DFlash eval; 5. the DFlash2 eval ------------------------------------------------------
study dflash eval "$L_TRAIN" default &
study dflash2 train "$L_TRAIN2" dflash2
wait
study dflash2 eval "$L_TRAIN2" dflash2

# --- 6. tau in vLLM vs in dflashkit eval; the projection model -------------------------------------------------------
if [ "$SCALE" = toy ]; then
  REPORT=$O/vllm/toy-eval/report.json  # the stand-in served its own toy pair: compare with dflashkit on that pair
  stage toy-eval 300 "$PY" -m dflashkit.eval --target "$O/vllm/toy/target" --drafter "$O/vllm/toy/drafter" \
    --dataset "$O/vllm/toy/chats.jsonl" --num-prompts 2 --max-new-tokens 8 --device cpu --dtype float32 \
    --baseline-prompts 0 --out "$O/vllm/toy-eval"
fi
STEP_TIMES=engine_run/vllm/e_projection_times.json  # the committed H200 step times, inside their run's archive
if [ ! -f "$O/vllm/e_projection_times.json" ] && [ -f "$ROOT/lab/results/engine_run.tar.xz" ]; then
  tar -xJOf "$ROOT/lab/results/engine_run.tar.xz" "$STEP_TIMES" > "$O/vllm/e_projection_times.json"
  echo "8B step times: the committed lab/results/engine_run.tar.xz:$STEP_TIMES" >> "$R/stages.txt"
fi
stage vllm-tau 120 "$PY" -m bench.bench_vllm --parts tau projection_model --out "$O/vllm" \
  --dflashkit-report "$REPORT"

# --- 7. last: `dflashkit eval --server` against a real `vllm serve` on loopback (needs uvicorn beside the slim vLLM)
if [ "$SCALE" != toy ] && [ -z "${SKIP_SERVER:-}" ] && [ -f "$DRAFTER/config.json" ]; then
  gpu_idle
  stage vllm-server 300 "${VENV[@]}" -m bench.bench_vllm --parts server --target "$T" --drafter "$DRAFTER" \
    --dataset "$D/mtbench.jsonl" --num-prompts 32 --out "$O/vllm"
fi
echo "[$(date +%T)] all done" >> "$R/stages.txt"
