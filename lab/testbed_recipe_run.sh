#!/usr/bin/env bash
# The recipe study of lab/NOTEBOOK.md on one H200 (issue 26). Stages, in order; each stage's results are in $RUN/out as
# soon as it ends, and $RUN/stages.txt says when each started and ended:
#   0. (background, beside the rest) the CUDA tests of the GPU paths: static draft step and graph replay, DFlash2,
#      the decode-attention kernel, training on the GPU, tree attention, packing;
#   1. the first user turn of every testbed ShareGPT conversation answered by the target (greedy, 256 new tokens);
#   2. (background; EXTRA_ROW=0 leaves it out) a second, sampled answer to each of those prompts (temperature 0.8,
#      top-p 0.95, seed 1), then the extra_answers row of the screen, which trains on both;
#   3. the screen: each variant of SCREEN trained online for SCREEN_EPOCHS epoch(s), PAR at a time, each evaluated
#      live as it ends (chain, greedy, bf16, MT-bench 80, 256 new tokens); beside it the variants of FULL (default:
#      the recipe as it is) for EPOCHS epochs, two at a time (FULL= leaves them out);
#   4. (COMBINE=0 leaves it out) the screen's winners combined (recipe_study --combine: every variant that beat the
#      default's tau by more than a seed replicate moves it, at once), trained for EPOCHS epochs, evaluated the same.
#
#   python -m lab.testbed_data --out .cache/gpu --sharegpt 0        # here, where the testbed packages are
#   export PYTHONPATH=$(bash lab/import_path.sh):/tmp/site           # H200: the checkout's code, the wheels
#   TARGET=/root/testbed/smollm2-bf16 DATA=/root/data RUN=/root/run bash lab/testbed_recipe_run.sh
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash lab/testbed_recipe_run.sh                                                               # CPU twin
#
# The toy scale runs every stage on the CPU in minutes (a few steps of a 1-layer drafter, 1 prompt): a check that
# the stages fit together, not a measurement. tau does not depend on timing, so runs share the GPU; their wall
# times and tokens/s are not those of a run alone. Sharing buys little: in the run of 2026-12-02 seven testbed
# trainings side by side made ~1.4x the tokens/s of one alone (each 1-epoch run took 497 s instead of ~115 s) and
# filled the 141 GB, and MT-bench evals beside them ran past a 240 s limit; hence PAR 3 and a longer eval limit.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-/root/data}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
EPOCHS=${EPOCHS:-3}
SCREEN_EPOCHS=${SCREEN_EPOCHS:-1}
PAR=${PAR:-3}
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; stage()
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# the rows the two runs of lab/NOTEBOOK.md left open against today's recipe (4k tokens per step, Muon since then)
SCREEN=${SCREEN:-default,seed_1,adamw,kl,lr_1e3}
FULL=${FULL-default}
EXTRA_ROW=${EXTRA_ROW:-1}
COMBINE=${COMBINE:-1}
if [ "$SCALE" = toy ]; then
  DEV=(--device cpu); SLOTS=8; NEW=8; LIMIT=(--limit 24); EVAL=(--num-prompts 1 --max-new-tokens 8)
  EXTRA=max_steps=2,num_hidden_layers=1,block_size=4,compile=false,mixed_precision=no,micro_batch_tokens=256,num_anchors=8,eval_samples=2,eval_anchors=4,max_length=256,save_every=0
  SCREEN=${TOY_SCREEN:-default,seed_1,adamw}; PAR=2; L_SCREEN=${L_SCREEN:-600}; L_FULL=${L_FULL:-600}
  L_EVAL=${L_EVAL:-300}; TESTS=0
else
  DEV=(); SLOTS=2048; NEW=256; LIMIT=(); EVAL=(--num-prompts 80 --max-new-tokens 256)
  EXTRA=max_length=2048,eval_samples=64,eval_every=0,save_every=100,keep_last=1,tokenize_workers=4
  L_SCREEN=${L_SCREEN:-600}; L_FULL=${L_FULL:-840}; L_EVAL=${L_EVAL:-600}; TESTS=${TESTS:-1}
fi

study() {  # NAME EPOCHS LIMIT ARGS...: one lab/recipe_study.py over its own OUT and work dir
  local name=$1 epochs=$2 limit=$3; shift 3
  stage "study-$name" $(( 2 * limit + L_EVAL + 300 )) "$PY" -m lab.recipe_study --target "$T" \
    --data "$R/regen.jsonl" --out "$O/$name" --work-dir "$R/work-$name" --epochs "$epochs" \
    --train-time-limit "$limit" --eval-time-limit "$L_EVAL" --extra-overrides "$EXTRA" \
    --dataset "$D/mtbench.jsonl" "${EVAL[@]}" "${DEV[@]}" "$@"
}
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

# --- 0. the CUDA tests, beside everything else (they skip themselves without a GPU) ---------------------------------
if [ "$TESTS" = 1 ]; then
  # from /tmp (the checkout's dflashkit/ folder would shadow the dflashkit namespace on the path); the
  # Triton-interpreter tests run a child from the checkout's root, where that shadowing happens: CPU tests that CI
  # runs, left out here
  ( cd /tmp && stage cuda-tests 900 "$PY" -m pytest -q -p no:cacheprovider -k "not in_interpreter" \
      "$ROOT/tests/unit/eval/test_eval_draft_layouts.py" "$ROOT/tests/unit/eval/test_eval_dflash2.py" \
      "$ROOT/tests/unit/extract/test_extract_decode_attention.py" "$ROOT/tests/unit/train/test_train_gpu.py" \
      "$ROOT/tests/unit/eval/test_eval_tree_attention.py" "$ROOT/tests/unit/train/test_train_packing.py" ) &
fi

# --- 1. the first user turn of every conversation answered by the target (greedy) ---------------------------------
[ -f "$D/sharegpt.jsonl" ] || gunzip -k "$D/sharegpt.jsonl.gz"
regen() {  # NAME OUT ARGS...
  local name=$1 out=$2; shift 2
  stage "$name" 420 "$PY" -m dflashkit.extract.regenerate --target "$T" --data "$D/sharegpt.jsonl" --out "$out" \
    --max-turns 1 --max-new-tokens "$NEW" --batch-size "$SLOTS" --max-prompt-length 1024 --no-progress \
    "${DEV[@]}" "${LIMIT[@]}" "$@"
}
[ -s "$R/regen.jsonl" ] || regen regenerate "$R/regen.jsonl"
echo "regenerated conversations: $(wc -l < "$R/regen.jsonl")" >> "$R/stages.txt"

# --- 2. a sampled second answer per prompt, then the extra_answers row (background) -----------------------------
if [ "$EXTRA_ROW" = 1 ]; then
  (
    [ -s "$R/regen_s1.jsonl" ] || regen regenerate-sampled "$R/regen_s1.jsonl" --temperature 0.8 --top-p 0.95 --seed 1
    echo "sampled conversations: $(wc -l < "$R/regen_s1.jsonl")" >> "$R/stages.txt"
    study extra "$SCREEN_EPOCHS" "$L_SCREEN" --variants extra_answers --extra-data "$R/regen_s1.jsonl"
  ) &
fi

# --- 3. the screen, and beside it the FULL variants for EPOCHS epochs -------------------------------------------------
if [ -n "$FULL" ]; then
  study full "$EPOCHS" "$L_FULL" --variants "$FULL" --parallel 2 &
fi
study screen "$SCREEN_EPOCHS" "$L_SCREEN" --variants "$SCREEN" --parallel "$PAR"

# --- 4. the winners at EPOCHS epochs --------------------------------------------------------------------------------
if [ "$COMBINE" = 1 ]; then
  study full-combo "$EPOCHS" "$L_FULL" --combine "$O/screen/results.json" --parallel 2
fi
wait
echo "[$(date +%T)] all done" >> "$R/stages.txt"
