#!/usr/bin/env bash
# The testbed run of lab/NOTEBOOK.md on two H200s (one works too, more slowly):
#   1. benchmarks: regeneration and DDP training on one vs two GPUs, extraction, the decode and block attention
#      kernels;
#   2. regenerate every user turn of the testbed's ShareGPT conversations with the SmolLM2-135M target, in order,
#      the prompts split over both GPUs;
#   3. train the 5-layer drafter online on all of it for STEPS steps twice at once, dpace (the default) on GPU 0
#      and ce on GPU 1: equal data, equal steps;
#   4. evaluate the dpace drafter (chain and tree, MT-bench 80 and HumanEval 164) on GPU 0 while GPU 1 measures
#      live chain tau on MT-bench for both objectives at the last step both runs saved.
#
#   python -m lab.testbed_data --out .cache/gpu --sharegpt 0          # where the testbed packages are installed
#   TARGET=/root/testbed/smollm2-bf16 DATA=.cache/gpu RUN=/root/run bash lab/testbed_tau_run.sh
#   SCALE=toy TARGET=testbed:smollm2 DEVICE=cpu bash lab/testbed_tau_run.sh        # the same stages, tiny, CPU
# Optional: BENCH=0 skips step 1, ONLY_BENCH=1 stops after it, ONLY=REGEX runs only the stages whose names it
# matches (e.g. ONLY_BENCH=1 ONLY='decode|extract' for two of the benchmarks); REGEN=FILE[.gz] reuses an
# earlier run's regenerated data (its regen-all.jsonl.gz) instead of step 2; STEPS sets the training steps of
# steps 3-4.
# MODE=curve replaces steps 3-4 with 3': the data-size curve at equal epochs (EPOCHS, default 3) and one larger
# drafter, e.g.
#   MODE=curve BENCH=0 REGEN=.cache/testbed-run/regen-all.jsonl.gz TARGET=... DATA=... RUN=... \
#     bash lab/testbed_tau_run.sh
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
MODE=${MODE:-compare}   # compare: dpace vs ce at equal steps (steps 3-4); curve: the data-size curve (step 3')
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$R"
dk=(python -m dflashkit)
if [ "$SCALE" = toy ]; then   # minutes on a CPU: a check that every stage runs, not a measurement
  # block 4: eval builds one verify step per block length (3, not 15), training scores 4x fewer positions
  LIMIT_CONV=6; NEW=8; BATCH=8; EVAL_PROMPTS=1; EVAL_NEW=8; MAXLEN=256; STEPS=6
  TRAIN_EXTRA=(num_hidden_layers=1 block_size=4 num_anchors=8 mixed_precision=no compile=false
               micro_batch_tokens=256 eval_samples=2 eval_anchors=4 save_every=2 keep_last=10)
  DT=float32; L_REGEN=${L_REGEN:-600}; L_TRAIN=${L_TRAIN:-600}; L_TRAIN_LONG=${L_TRAIN_LONG:-600}
  L_EVAL=${L_EVAL:-600}; L_EVAL_SMALL=${L_EVAL_SMALL:-600}; BENCH=0; EPOCHS=2
else
  LIMIT_CONV=0; NEW=256; BATCH=${BATCH:-1024}; EVAL_PROMPTS=164; EVAL_NEW=256; MAXLEN=2048; STEPS=${STEPS:-1200}
  # the recipe's tokens per step and optimizer (4k, Muon since lab/NOTEBOOK.md "The recipe study"; the runs of
  # 2026-11-30 in lab/NOTEBOOK.md had micro_batch_tokens=16384 and AdamW: add those here to repeat them)
  TRAIN_EXTRA=(grad_accum=1 eval_samples=64 eval_every=0 save_every=100 keep_last=4
               tokenize_workers=4
               compile=true)
  DT=bfloat16; L_REGEN=${L_REGEN:-240}; L_TRAIN=${L_TRAIN:-420}; L_TRAIN_LONG=${L_TRAIN_LONG:-900}
  L_EVAL=${L_EVAL:-270}; L_EVAL_SMALL=${L_EVAL_SMALL:-150}; EPOCHS=${EPOCHS:-3}
  BENCH=${BENCH:-1}
fi
NGPU=$([ "$DEVICE" = cuda ] && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
G0=0; G1=$([ "$NGPU" -ge 2 ] && echo 1 || echo 0); BOTH=$([ "$NGPU" -ge 2 ] && echo 0,1 || echo 0)
NPROC=$([ "$NGPU" -ge 2 ] || [ "$DEVICE" = cpu ] && echo 2 || echo 1)  # ranks of the multi-GPU stages

stage() {  # stage NAME GPUS SECONDS COMMAND...: run with a time limit on the given GPUs, log, record rc and time
  local name=$1 gpu=$2 limit=$3; shift 3
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi  # ONLY=REGEX: only the stages it matches
  local start; start=$(date +%s)
  echo "[$(date +%T)] $name (gpu $gpu): $*" >> "$R/stages.txt"
  CUDA_VISIBLE_DEVICES=$gpu timeout -s INT -k 30 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name: rc=$rc $(( $(date +%s) - start )) s" >> "$R/stages.txt"
  return $rc
}
multi=(torchrun --standalone --nproc_per_node "$NPROC")

train_and_export() {  # NAME GPU LIMIT DATA LOSS [KEY=VALUE...]: online training, then the export
  # length: STEPS steps by default; pass epochs=N (and max_steps=0) to train whole epochs instead
  local name=$1 gpu=$2 limit=$3 data=$4 loss=$5; shift 5
  stage "train-$name" "$gpu" "$limit" "${dk[@]}" train --recipe recipes/smollm2-135m.yaml --target "$T" \
    --data "$data" --output-dir "$R/train-$name" --loss "$loss" "export_dir=$R/drafter-$name" \
    "max_length=$MAXLEN" "max_steps=$STEPS" epochs=100 wandb=false progress=false "${TRAIN_EXTRA[@]}" "$@"
}

export_step() {  # NAME GPU STEP: export the checkpoint of that step (equal-step comparisons)
  local ckpt; ckpt=$(printf "%s/train-%s/checkpoints/step-%08d" "$R" "$1" "$3")
  [ -d "$ckpt" ] && stage "export-$1-$3" "$2" 120 python -m dflashkit.train.export "$ckpt" "$R/drafter-$1-$3"
}

eval_chain_mtbench() {  # DRAFTER GPU: live chain tau on MT-bench
  [ -f "$R/drafter-$1/config.json" ] || return 1
  stage "eval-$1" "$2" "$L_EVAL_SMALL" "${dk[@]}" eval --target "$T" --drafter "$R/drafter-$1" \
    --dataset "$D/mtbench.jsonl" --num-prompts "$EVAL_PROMPTS" --mode chain --max-new-tokens "$EVAL_NEW" \
    --baseline-prompts 8 --reference-prompts 2 --device "$DEVICE" --dtype "$DT" --out "$R/eval-$1"
}

steps_saved() {  # NAME: the steps of the run's checkpoints, one per line, sorted
  ls "$R/train-$1/checkpoints" 2>/dev/null | sed -n 's/^step-0*\([0-9][0-9]*\)$/\1/p' | sort -n
}

echo "[$(date +%T)] start: $NGPU GPU(s), scale $SCALE" >> "$R/stages.txt"

# --- 1. both GPUs: one- and two-GPU benchmarks (regeneration, DDP training) --------------------------------------
if [ "$BENCH" = 1 ]; then
  stage bench-regenerate "$BOTH" 120 "${multi[@]}" -m bench.bench_regenerate --target "$T" --data "$D/sharegpt.jsonl" \
    --prompts 4096 --max-new-tokens 384 --batch "$BATCH" --hf-prompts 256 --out "$R/regenerate_h200.json"
  # GPU 1: extraction at the disk's speed, then the drafter's block attention alone, compiled for static and for
  # dynamic shapes (the trainer's case), on an even and on a training-like ragged micro-batch. GPU 0 meanwhile:
  # more slots (the decode step of a 135M model is mostly fixed per-kernel latency, so tokens/s should grow with
  # them), then the decode kernel against SDPA on the same prompts at both slot counts
  (
    stage bench-extract-testbed "$G1" 100 python -m bench.bench_extract --target "$T" --batches 32 --repeats 3 \
      --out-dir "$R/bench-extract-tmp" --out "$R/extract_smollm2.json"
    stage bench-extract-qwen3-8b "$G1" 150 python -m bench.bench_extract --random-qwen3-8b --layer-ids 1 9 17 25 33 \
      --batch 8 --seq 2048 --batches 8 --repeats 2 --out-dir "$R/bench-extract-tmp" --out "$R/extract_qwen3_8b.json"
    rm -rf "$R/bench-extract-tmp"
    stage bench-block-attention "$G1" 150 python -m lab.bench_block_attention --variants flex,flex_dynamic,split \
      --out "$R/block_attention_smollm2.json"
    stage bench-block-attention-ragged "$G1" 150 python -m lab.bench_block_attention --num-seqs 13 --min-len 256 \
      --max-len 1024 --variants flex,flex_dynamic,split --out "$R/block_attention_smollm2_ragged.json"
  ) &
  stage bench-regenerate-2048 "$G0" 120 python -m bench.bench_regenerate --target "$T" --data "$D/sharegpt.jsonl" \
    --prompts 8192 --max-new-tokens 384 --batch 2048 --no-hf --out "$R/regenerate_h200_2048.json"
  stage bench-decode-attention "$G0" 240 python -m bench.bench_regenerate --target "$T" --data "$D/sharegpt.jsonl" \
    --prompts 4096 --max-new-tokens 384 --batch "$BATCH" --no-hf --decode-attention compare \
    --out "$R/regenerate_decode_attention_h200.json"
  stage bench-decode-attention-2048 "$G0" 300 python -m bench.bench_regenerate --target "$T" \
    --data "$D/sharegpt.jsonl" --prompts 8192 --max-new-tokens 384 --batch 2048 --no-hf --decode-attention compare \
    --out "$R/regenerate_decode_attention_h200_2048.json"
  wait
  [ -f "$R/regenerate_h200_2048.json" ] && REGEN_SLOTS=2048
  stage bench-train-ddp "$BOTH" 200 "${multi[@]}" -m bench.bench_train_throughput --target "$T" \
    --out "$R/train_throughput_smollm2.json" --profile "$R/profile_train_smollm2.txt"
fi
if [ "${ONLY_BENCH:-0}" = 1 ]; then echo "[$(date +%T)] all done (ONLY_BENCH=1)" >> "$R/stages.txt"; exit 0; fi

# --- 2. both GPUs: every user turn of every conversation answered by the target, in order ------------------------
if [ -n "${REGEN:-}" ]; then  # the regenerated data of an earlier run (e.g. its regen-all.jsonl.gz)
  case "$REGEN" in *.gz) gunzip -c "$REGEN" > "$R/regen.jsonl" ;; *) cp "$REGEN" "$R/regen.jsonl" ;; esac
  echo "[$(date +%T)] regenerate: reused $REGEN ($(wc -l < "$R/regen.jsonl") conversations)" >> "$R/stages.txt"
else
  stage regenerate "$BOTH" "$L_REGEN" "${multi[@]}" -m dflashkit.extract.regenerate --target "$T" \
    --data "$D/sharegpt_turns.jsonl" --out "$R/regen.jsonl" --resume --max-new-tokens "$NEW" \
    --batch-size "${REGEN_SLOTS:-$BATCH}" \
    --max-prompt-length 1024 $([ "$LIMIT_CONV" -gt 0 ] && echo --limit "$LIMIT_CONV") --dtype "$DT" --no-progress \
    $([ "$DEVICE" = cpu ] && echo --device cpu)
fi
stage subsets "$G0" 120 python -m lab.testbed_subsets --regen "$R/regen.jsonl" --out "$R/data" --first 5000 11146
gzip -c "$R/data/all.jsonl" > "$R/regen-all.jsonl.gz"  # the regenerated data travels back (no weights do)

drafter_of() {  # NAME GPU: prints X such that $R/drafter-X is the run's drafter: its final export, else an export
  # of its last checkpoint (a run stopped by its time limit); prints nothing when the run saved nothing
  if [ -f "$R/drafter-$1/config.json" ]; then echo "$1"; return; fi
  local last; last=$(steps_saved "$1" | tail -1)
  [ -n "$last" ] || return 1
  [ -f "$R/drafter-$1-$last/config.json" ] || export_step "$1" "$2" "$last" || return 1
  echo "$1-$last"
}

bench_eval_full() {  # DRAFTER_DIR GPU: chain and tree, MT-bench and HumanEval, with speedups and the lossless check
  [ -f "$1/config.json" ] && stage eval-main "$2" "$L_EVAL" python -m bench.bench_eval --target "$T" \
    --drafter "$1" --dataset "$D/mtbench.jsonl" "$D/humaneval.jsonl" --num-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$EVAL_NEW" --modes chain tree --tree-budget 64 --tree-top-k 8 --baseline-prompts 10 \
    --reference-prompts 8 --dtype "$DT" --out "$R/bench_eval.json"
}

# --- 3'. (MODE=curve) the data-size curve at equal epochs, and a larger drafter ---------------------------------
# GPU 0: every answered turn (all.jsonl), EPOCHS epochs, then its full evaluation. GPU 1 meanwhile: the first user
# turns of 5,000 and of 11,146 conversations, EPOCHS epochs each, then the 11,146 set again with an 8-layer
# drafter (capacity at equal data), then live chain tau on MT-bench for each. Default objective (dpace) throughout.
curve() {
  local ep=(max_steps=0 "epochs=$EPOCHS") e=e$EPOCHS
  (
    train_and_export "all-$e" "$G0" "$L_TRAIN_LONG" "$R/data/all.jsonl" dpace "${ep[@]}"
    local d; d=$(drafter_of "all-$e" "$G0") && bench_eval_full "$R/drafter-$d" "$G0"
  ) &
  (
    train_and_export "first5000-$e" "$G1" "$L_TRAIN" "$R/data/first5000.jsonl" dpace "${ep[@]}"
    train_and_export "first11146-$e" "$G1" "$L_TRAIN" "$R/data/first11146.jsonl" dpace "${ep[@]}"
    train_and_export "first11146-$e-l8" "$G1" "$L_TRAIN" "$R/data/first11146.jsonl" dpace "${ep[@]}" \
      num_hidden_layers=8
    local run d
    for run in "first5000-$e" "first11146-$e" "first11146-$e-l8"; do
      d=$(drafter_of "$run" "$G1") && eval_chain_mtbench "$d" "$G1"
    done
  ) &
  wait
}

if [ "$MODE" = curve ]; then
  curve
else
  # --- 3. (MODE=compare) equal data, equal steps: dpace (the default) on GPU 0, ce on GPU 1, at the same time
  train_and_export dpace "$G0" "$L_TRAIN" "$R/data/all.jsonl" dpace &
  train_and_export ce "$G1" "$L_TRAIN" "$R/data/all.jsonl" ce &
  wait
  # a run cut by its time limit checkpointed where it stopped: compare both at the last step they both saved
  common=$(comm -12 <(steps_saved dpace | sort) <(steps_saved ce | sort) | sort -n | tail -1)
  echo "[$(date +%T)] checkpoints: dpace $(steps_saved dpace | tr '\n' ' '); ce $(steps_saved ce | tr '\n' ' ');" \
    "compared at step ${common:-none}" >> "$R/stages.txt"
  if [ -n "$common" ]; then
    export_step dpace "$G0" "$common" & export_step ce "$G1" "$common" & wait
  fi
  main=$R/drafter-$(drafter_of dpace "$G0")  # the default objective's drafter

  # --- 4. (MODE=compare) evaluation: the default drafter in full on GPU 0, both drafters at the common step on
  # GPU 1
  bench_eval_full "$main" "$G0" &
  if [ -n "$common" ]; then
    ( eval_chain_mtbench "ce-$common" "$G1"; eval_chain_mtbench "dpace-$common" "$G1" ) &
  fi
  wait
  if [ -f "$main/config.json" ] && [ ! -f "$R/bench_eval.json" ]; then  # no report at all: measure chain tau eagerly
    stage eval-dpace-eager "$G0" "$L_EVAL_SMALL" "${dk[@]}" eval --target "$T" --drafter "$main" \
      --dataset "$D/mtbench.jsonl" --num-prompts "$EVAL_PROMPTS" --mode chain --max-new-tokens "$EVAL_NEW" \
      --baseline-prompts 2 --reference-prompts 2 --device "$DEVICE" --dtype "$DT" --no-cuda-graphs \
      --out "$R/eval-dpace-eager"
  fi
fi
echo "[$(date +%T)] all done" >> "$R/stages.txt"
