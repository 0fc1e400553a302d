#!/usr/bin/env bash
# vLLM 0.26 against 0.24 on one drafter, on one H100 where the testbed target, both vLLM kits (0.26 in
# /tmp/vllm-site, 0.24 in /tmp/vllm24-site: ../shared/vllm/README.md) and the testbed wheels (/tmp/site) are
# installed. Stages, in the order STAGES names them (default "train serve chain compare"; "grid" is a later lease
# of its own); each writes into $RUN/<stage>/ and $RUN/stages.txt says when each started and ended, with its exit
# status:
#   train    the recipe (recipes/smollm2-135m.yaml) trained online on builtin:sharegpt as the recipe takes it (no
#            answers by the target), planned to end at STEPS (default 1000: ~100-150 s on one H100), then exported
#            with `dflashkit export --for vllm` in the 0.24 environment (its rules are the stricter);
#            ~4 min with start-up; DRAFTER=DIR (an export of an earlier lease) skips it;
#   serve    `dflashkit eval --engine vllm --per-prompt` on MT-bench's 80 first turns, greedy, k = K (default 15),
#            concurrency LEVELS (default "1 16"), prefix caching on, vLLM 0.24 then 0.26 (one engine at a time,
#            each shut down before the next): serve/v024/, serve/v026/ (report.json, outputs.jsonl); ~10 min;
#   chain    `dflashkit eval --mode chain` of the same export on the same prompts (greedy, bf16): chain/; ~2 min;
#   compare  compare.json: τ 0.24 against 0.26 (goal within 2%), outputs with and without the drafter per release
#            (identical of 80, the differing ones), the drafter's outputs release against release, the chain τ;
#   grid     vLLM 0.26 alone: k = GRID_KS (default "1 3 7 15") at levels GRID_LEVELS (default "1 4 16 64 128"),
#            3 repeats of at least 4 waves each, the per-batch-size schedule derived and served (on 0.26's V2
#            runner, drafter/serving_rules.py rule "schedule_runner"): grid/; ~15 min, a lease of its own (DRAFTER=DIR).
#
#   export PYTHONPATH=$(bash lab/import_path.sh):/tmp/site
#   TARGET=/root/testbed/smollm2-bf16 RUN=/root/run026 nohup bash lab/testbed_engine026_lease.sh &       # H100
#   STAGES=grid DRAFTER=/root/run026/train/drafter TARGET=... RUN=/root/run026 nohup bash ... &              # later
#   SCALE=toy TARGET=testbed:smollm2 DATA=.cache/toy RUN=/tmp/toy PYTHON=.venv/bin/python \
#     bash lab/testbed_engine026_lease.sh                                                          # CPU twin
#
# The toy scale runs every stage on the CPU at toy sizes (DATA/sharegpt.jsonl and DATA/mtbench.jsonl instead of
# the builtin sets; vLLM replaced by its CPU twin following 0.24 or 0.26, lab/standin_vllm_eval.py): a check that
# the stages fit together, not a measurement. Every result file is small (reports, outputs.jsonl: < 1 MiB); the
# drafter stays in $RUN/train/drafter.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
R=${RUN:-/root/run026}
D=${DATA:-.}
SCALE=${SCALE:-full}
STAGES=${STAGES:-train serve chain compare}
V24=${VLLM24_SITE:-/tmp/vllm24-site}
V26=${VLLM26_SITE:-/tmp/vllm-site}
absolute() { [ -e "$1" ] && echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" || echo "$1"; }
T=$(absolute "$T")
if [ -n "${DRAFTER:-}" ]; then DRAFTER=$(cd "$DRAFTER" && pwd) || exit 1; fi
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; note(), stage()
if [ "$SCALE" = toy ]; then
  K=${K:-3}; LEVELS=${LEVELS:-1 2}; GRID_KS=${GRID_KS:-1 3}; GRID_LEVELS=${GRID_LEVELS:-1 2}
  TRAIN_DATA=$D/sharegpt.jsonl; PROMPTS=$D/mtbench.jsonl
  TRAIN=(max_steps=2 num_hidden_layers=1 block_size=4 compile=false mixed_precision=no micro_batch_tokens=1024
    num_anchors=8 eval_samples=2 max_length=256 tokenize_workers=0)
  EVAL=(--num-prompts 2 --max-new-tokens 8); CHAIN=(--device cpu --dtype float32)
  GRID=(--repeats 2 --min-waves 1 --max-requests-per-level 2)
  ENV24=(); SERVE24=("$PY" -m lab.standin_vllm_eval 0.24.0)
  SERVE26=("$PY" -m lab.standin_vllm_eval 0.26.0)
else
  K=${K:-15}; LEVELS=${LEVELS:-1 16}; GRID_KS=${GRID_KS:-1 3 7 15}; GRID_LEVELS=${GRID_LEVELS:-1 4 16 64 128}
  # the builtin sets need the testbed packages; a GPU machine without them takes the files of lab/testbed_data.py
  TRAIN_DATA=${TRAIN_DATA:-builtin:sharegpt}; PROMPTS=${PROMPTS:-builtin:mtbench}
  TRAIN=(max_steps="${STEPS:-1000}" data_limit="${DATA_LIMIT:-20000}" eval_every=0 save_every=500 keep_last=1)
  EVAL=(--num-prompts 80 --max-new-tokens 256); CHAIN=(--dtype bfloat16)
  GRID=(--repeats 3 --min-waves 4 --max-requests-per-level 8)
  ENV24=(env VLLM_SITE="$V24" bash "$ROOT/lab/vllm_env.sh")  # a command in the 0.24 kit's environment
  SERVE24=("${ENV24[@]}" "$PY" -m dflashkit.eval)
  SERVE26=(env VLLM_SITE="$V26" bash "$ROOT/lab/vllm_env.sh" "$PY" -m dflashkit.eval)
fi
for s in $STAGES; do
  case $s in
    train|serve|chain|compare|grid) ;;
    *) note "unknown stage $s (train, serve, chain, compare, grid)"; exit 2 ;;
  esac
done
if [ "$SCALE" != toy ]; then  # both kits must be there before any stage runs
  for site in $V24 $V26; do
    [ -f "$site/vllm-env.sh" ] || { note "no vLLM kit in $site (../shared/vllm/README.md)"; exit 2; }
  done
fi
gpu_idle() {  # until no process computes on the GPU (at most 120 s): vLLM's start-up profiling must run alone
  command -v nvidia-smi > /dev/null || return 0
  local k
  for k in $(seq 120); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  note "the GPU is still busy after 120 s"
}
DRAFTER=${DRAFTER:-$R/train/drafter}
note "start: scale $SCALE, stages $STAGES, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)"
for s in $STAGES; do
  mkdir -p "$R/$s"
  case $s in
  train)
    stage train 900 "$PY" -m dflashkit.train --recipe "$ROOT/recipes/smollm2-135m.yaml" --target "$T" \
      --data "$TRAIN_DATA" --output-dir "$R/train/run" "${TRAIN[@]}" \
    && stage export 300 "${ENV24[@]}" "$PY" -m dflashkit.train.export "$R/train/run" "$DRAFTER" --for vllm \
      --overwrite
    cp "$R/train/run/metrics.jsonl" "$R/train/run/summary.json" "$R/train/" 2>/dev/null ;;
  serve)
    for release in 24 26; do
      gpu_idle
      SERVE=("${SERVE24[@]}"); [ "$release" = 26 ] && SERVE=("${SERVE26[@]}")
      # shellcheck disable=SC2086
      stage "serve-0$release" 1200 "${SERVE[@]}" --engine vllm --target "$T" --drafter "$DRAFTER" \
        --dataset "$PROMPTS" "${EVAL[@]}" --num-speculative-tokens "$K" --concurrency $LEVELS --repeats 1 \
        --max-requests-per-level 16 --prefix-caching on --no-schedule-run --per-prompt \
        --out "$R/serve/v0$release" --overwrite
    done ;;
  chain)
    gpu_idle
    stage chain 600 "$PY" -m dflashkit.eval --target "$T" --drafter "$DRAFTER" --dataset "$PROMPTS" "${EVAL[@]}" \
      --mode chain --baseline-prompts 0 "${CHAIN[@]}" --out "$R/chain/report" --overwrite ;;
  compare)
    stage compare 120 "$PY" -m lab.engine026_compare --served "0.24=$R/serve/v024" "0.26=$R/serve/v026" \
      --chain "$R/chain/report" --out "$R/compare/compare.json" ;;
  grid)
    gpu_idle
    # shellcheck disable=SC2086
    stage grid 3000 "${SERVE26[@]}" --engine vllm --target "$T" --drafter "$DRAFTER" --dataset "$PROMPTS" \
      "${EVAL[@]}" --num-speculative-tokens $GRID_KS --concurrency $GRID_LEVELS "${GRID[@]}" --prefix-caching on \
      --out "$R/grid/report" --overwrite ;;
  esac
done
note "all done"
