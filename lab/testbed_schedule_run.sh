#!/usr/bin/env bash
# One H200 session for the serving plan (lab/NOTEBOOK.md "The serving plan"): the testbed recipe's causal-in-block
# drafter served by vLLM at k = KS, the n-gram baseline, the per-batch-size schedule derived from those cells and
# served by one more engine. Stages, in order (a stage's results are in $RUN/out as soon as it ends):
#   1. the first user turn of every testbed ShareGPT conversation answered by the target (256 new tokens);
#   2. the recipe (recipes/smollm2-135m.yaml: causal-in-block) trained online for EPOCHS epochs, stopped at
#      L_TRAIN seconds if not done (it checkpoints and exports);
#   3. vLLM alone on the GPU: `dflashkit eval --engine vllm` (bench/bench_vllm.py --parts serve) at k = KS and
#      concurrency LEVELS, REPEATS runs per cell of at least 4 waves, each engine's CUDA graphs covering its
#      largest step, baselines ngram, mtp (skipped: the testbed has no MTP head) and v1 (no speculation on the V1
#      model runner, the one a schedule runs on), the schedule served last (serve/schedule.json);
#      (BASELINES=none: no baseline; SCHEDULE_RUN=0: the schedule derived but not served: on vLLM 0.24 it runs on the
#      V1 runner, measured 0.20-0.39x of the default runner without speculation, lab/NOTEBOOK.md)
#   4. (SERVER=1) two `vllm serve` on loopback (none, the drafter at the largest k) swept by `dflashkit eval
#      --server` over the same levels, repeats and requests, each cell beside stage 3's (vllm/f_server.json);
#   5. (PROJECTION=1) the 8B-shaped projection at each k of KS_PROJ (default KS) and level of LEVELS_PROJ (default
#      LEVELS) (bench_vllm.py --parts projection; random weights), modelled with stage 3's acceptance; last, as
#      each of its engines' step times is kept as soon as it ends (e_projection_times.partial.json).
# EVAL_EVERY=N logs the held-out τ_walk every N steps of stage 2 (lab/time_to_quality.py reads it; default 0:
# only at the end). KEEP_DRAFTER=1 leaves the export in 15 MiB pieces under $RUN/out/drafter/ (see below).
# DRAFTER=DIR (an export of an earlier lease) skips stages 1 and 2. To keep this lease's drafter for the next one,
# bring it back in pieces of at most 15 MiB: `tar cf - -C $RUN/work/train/default/export . | split -b 15M - \
# $OUT/drafter.tar.`, then here `cat drafter.tar.* | tar x -C .cache/drafter` and carry .cache/drafter.
#
#   python -m lab.testbed_data --out .cache/gpu --sharegpt 0        # here, where the testbed packages are
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash lab/testbed_schedule_run.sh # H200
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash lab/testbed_schedule_run.sh                                                           # CPU twin
#
# The toy scale runs every stage on the CPU, vLLM replaced by its CPU stand-in (lab/standin_bench_vllm.py, modelled
# step times): a check that the stages fit together, not a measurement.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
EPOCHS=${EPOCHS:-3}
# a relative DRAFTER is the caller's: resolved before run_lib.sh moves the shell into $R
if [ -n "${DRAFTER:-}" ]; then DRAFTER=$(cd "$DRAFTER" && pwd) || exit 1; fi
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; stage()
if [ "$SCALE" = toy ]; then
  DEV=(--device cpu); SLOTS=8; NEW=16; LIMIT=(--limit 16); KS=${KS_TOY:-1 3}; LEVELS=${LEVELS_TOY:-1 4}
  EXTRA=max_steps=2,num_hidden_layers=1,block_size=4,compile=false,mixed_precision=no,micro_batch_tokens=1024,num_anchors=8,eval_samples=2,max_length=256
  VLLM=(--num-prompts 2 --max-new-tokens 8 --repeats 2 --projection-new-tokens 4 --projection-prompt-tokens 6)
  BENCH_VLLM=lab.standin_bench_vllm  # bench/bench_vllm.py over the CPU twin
  L_TRAIN=${L_TRAIN:-900}; L_VLLM=${L_VLLM:-900}; L_PROJ=${L_PROJ:-900}
else
  DEV=(); SLOTS=2048; NEW=256; LIMIT=(); KS=${KS:-3 7 15}; LEVELS=${LEVELS:-1 4 16 64 128}
  EXTRA=max_length=2048,eval_samples=64,eval_every=${EVAL_EVERY:-0},save_every=200,keep_last=2,tokenize_workers=4
  VLLM=(--num-prompts 80 --max-new-tokens 256 --repeats 3 --max-requests-per-level 8 --min-waves 4 \
    --gpu-memory-utilization 0.3)
  BENCH_VLLM=bench.bench_vllm
  # one 30-minute lease (~25 min after the carry calls) holds regeneration (42 s), 300 s of training (~1,380 of the
  # recipe's 2,723 steps at 31.5k tokens/s, H200 2026-12-03) and the sweep: seven engines (no speculation, k = 3,
  # 7, 15, n-gram, v1, the schedule), each ~2.5 min (start-up 20-100 s, the levels at 4 waves). k = 1 is left out
  # by default: on 2026-12-03 it never beat no speculation (0.73-1.04x, lab/NOTEBOOK.md); KS="1 3 7 15" adds it.
  L_TRAIN=${L_TRAIN:-300}; L_VLLM=${L_VLLM:-1080}; L_PROJ=${L_PROJ:-480}
fi
BASELINES=${BASELINES:-ngram mtp v1}  # BASELINES=v1 keeps a lease for what an earlier run lacks; none: no baseline
BASE=(--baseline $BASELINES); [ "$BASELINES" = none ] && BASE=()
SERVE_EXTRA=(); [ "${SCHEDULE_RUN:-1}" = 0 ] && SERVE_EXTRA=(--no-schedule-run)  # the schedule derived, not served
VENV=(bash "$ROOT/lab/vllm_env.sh" "$PY")  # the slim vLLM's environment (../shared/vllm/README.md)
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

if [ -n "${DRAFTER:-}" ]; then  # an exported drafter from an earlier lease: stages 1 and 2 are skipped
  echo "[$(date +%T)] drafter given: $DRAFTER" >> "$R/stages.txt"
else
# --- 1. the first user turn of every conversation answered by the target -------------------------------------------
first_turns

# --- 2. the recipe's drafter -------------------------------------------------------------------------------------------
stage train-recipe $(( L_TRAIN + 300 )) "$PY" -m lab.recipe_study --target "$T" --data "$R/regen.jsonl" \
  --out "$O/recipe" --work-dir "$R/work" --variants default --parallel 1 --epochs "$EPOCHS" --stage train \
  --train-time-limit "$L_TRAIN" --extra-overrides "$EXTRA" --dataset "$D/mtbench.jsonl" "${DEV[@]}"
DRAFTER=$R/work/train/default/export
if [ -n "${KEEP_DRAFTER:-}" ] && [ -d "$DRAFTER" ]; then
  mkdir -p "$O/drafter" && tar cf - -C "$DRAFTER" . | split -b 15M - "$O/drafter/drafter.tar."
fi
fi

# --- 3. vLLM alone: every k, the baselines, the schedule ---------------------------------------------------------------
# shellcheck disable=SC2086
stage vllm-schedule "$L_VLLM" "${VENV[@]}" -m "$BENCH_VLLM" --parts serve --target "$T" \
  --drafter "$DRAFTER" --serve-ks $KS --concurrency $LEVELS "${BASE[@]}" "${SERVE_EXTRA[@]}" --prefix-caching on \
  --dataset "$D/mtbench.jsonl" --out "$O/vllm" "${VLLM[@]}"

# --- 4. (SERVER=1) the same sweep against live `vllm serve` processes -------------------------------------------------
if [ -n "${SERVER:-}" ]; then
  # shellcheck disable=SC2086
  stage vllm-server "${L_SERVER:-600}" "${VENV[@]}" -m "$BENCH_VLLM" --parts server --target "$T" \
    --drafter "$DRAFTER" --serve-ks $KS --concurrency $LEVELS --dataset "$D/mtbench.jsonl" --out "$O/vllm" \
    "${VLLM[@]}"
fi
# --- 5. (PROJECTION=1) the 8B-shaped step times at each k and the schedule an 8B user would deploy --------------------
if [ -n "${PROJECTION:-}" ]; then
  # shellcheck disable=SC2086
  stage projection "$L_PROJ" "${VENV[@]}" -m "$BENCH_VLLM" --parts projection --ks ${KS_PROJ:-$KS} \
    --concurrency ${LEVELS_PROJ:-$LEVELS} --out "$O/vllm" "${VLLM[@]}"
fi

echo "[$(date +%T)] all done" >> "$R/stages.txt"
