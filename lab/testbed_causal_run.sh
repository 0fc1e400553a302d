#!/usr/bin/env bash
# One H200 session for the serving plan's first question (lab/NOTEBOOK.md "A drafter for every k"): the
# causal-in-block layout (DrafterConfig.causal: every layer sees the whole context, causal inside the block; the
# testbed recipe's since that run) against the non-causal block, same data, seed and recipe otherwise, served by
# vLLM at several num_speculative_tokens. Stages, in order (a stage's results are in $RUN/out as soon as it ends):
#   1. the first user turn of every testbed ShareGPT conversation answered by the target (256 new tokens);
#   2. both layouts trained online for EPOCHS epochs side by side (lab/recipe_study.py --stage train, rows
#      `causal` and `non_causal`), each stopped at L_TRAIN seconds if not done (it checkpoints and exports);
#   3. vLLM alone on the GPU: tau and per-position acceptance of both exports at k = KS
#      (bench/bench_vllm.py --parts tau_k: one engine per pair, MT-bench 80, greedy, 256 new tokens);
#   4. (EVAL_STAGE=1) both exports in `dflashkit eval` (chain, MT-bench 80), side by side.
#
#   python -m lab.testbed_data --out .cache/gpu --sharegpt 0        # here, where the testbed packages are
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash lab/testbed_causal_run.sh   # H200
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash lab/testbed_causal_run.sh                                                             # CPU twin
#
# The toy scale runs every stage on the CPU in minutes, vLLM replaced by its CPU stand-in (lab/standin_bench_vllm.py,
# which decodes with dflashkit's own chain decoder): a check that the stages fit together, not a measurement.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpu}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
EPOCHS=${EPOCHS:-3}
KS=${KS:-1 3 7 15}
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; stage()
if [ "$SCALE" = toy ]; then
  DEV=(--device cpu); SLOTS=8; NEW=8; LIMIT=(--limit 24); EVAL=(--num-prompts 1 --max-new-tokens 8)
  EXTRA=max_steps=2,num_hidden_layers=1,block_size=4,compile=false,mixed_precision=no,micro_batch_tokens=256,num_anchors=8,eval_samples=2,eval_anchors=4,max_length=256
  VLLM=(--num-prompts 1 --max-new-tokens 8); KS=${KS_TOY:-1 3}; BENCH_VLLM=lab.standin_bench_vllm  # the CPU twin
  L_TRAIN=${L_TRAIN:-900}; L_VLLM=${L_VLLM:-600}; L_EVAL=${L_EVAL:-600}
else
  DEV=(); SLOTS=2048; NEW=256; LIMIT=(); EVAL=(--num-prompts 80 --max-new-tokens 256)
  EXTRA=max_length=2048,eval_samples=64,eval_every=0,save_every=200,keep_last=2,tokenize_workers=4
  VLLM=(--num-prompts 80 --max-new-tokens 256 --gpu-memory-utilization 0.3); BENCH_VLLM=bench.bench_vllm
  L_TRAIN=${L_TRAIN:-660}; L_VLLM=${L_VLLM:-480}; L_EVAL=${L_EVAL:-300}
fi
VENV=(bash "$ROOT/lab/vllm_env.sh" "$PY")  # the slim vLLM's environment (../shared/vllm/README.md)
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

# --- 1. the first user turn of every conversation answered by the target -------------------------------------------
first_turns

study() {  # STAGE LIMIT: both layouts through lab/recipe_study.py, side by side
  stage "$1-layouts" "$2" "$PY" -m lab.recipe_study --target "$T" --data "$R/regen.jsonl" \
    --out "$O/layouts" --work-dir "$R/work" --variants causal,non_causal --parallel 2 --epochs "$EPOCHS" \
    --stage "$1" --train-time-limit "$L_TRAIN" --eval-time-limit "$L_EVAL" --extra-overrides "$EXTRA" \
    --dataset "$D/mtbench.jsonl" "${EVAL[@]}" "${DEV[@]}"
}

# --- 2. both layouts trained side by side ----------------------------------------------------------------------------
study train $(( L_TRAIN + 300 ))

# --- 3. vLLM alone: tau at each k for both exports -------------------------------------------------------------------
stage vllm-tau-k "$L_VLLM" "${VENV[@]}" -m "$BENCH_VLLM" --parts tau_k --target "$T" \
  --drafters "causal=$R/work/train/causal/export" "non_causal=$R/work/train/non_causal/export" --ks $KS \
  --dataset "$D/mtbench.jsonl" --out "$O/vllm" "${VLLM[@]}"

# --- 4. (EVAL_STAGE=1) dflashkit eval of both exports ----------------------------------------------------------------------
[ -n "${EVAL_STAGE:-}" ] && study eval $(( 2 * L_EVAL + 120 ))
echo "[$(date +%T)] all done" >> "$R/stages.txt"
