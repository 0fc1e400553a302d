#!/usr/bin/env bash
# The quality issue's remaining GPU runs on one H200, in the order STAGES names them (default "kernels pairs
# ttq": the two that need no target first, while it is copied in); each stage's results are in $RUN/<stage>/
# (or $RUN/out for kernels and pairs) as soon as it ends, and $RUN/stages.txt says when each started and ended,
# with its exit status:
#   kernels  the CUDA tests of DFlash2's kernels (the pairwise selector term, train/selector_pair.py; the in-block
#            convolution, train/dynamic_conv.py) and of the compiled layers against eager ones (compile_layers'
#            options: test_train_packing.py, test_train_gpu.py; the held-out evaluation through the training's
#            compiled graphs: test_train_eval_consistency.py), then the kernels' benchmarks at the testbed's
#            micro-batch (lab/bench_selector_pair.py, lab/bench_dynamic_conv.py); ~3 min, no target needed;
#   ttq      time to quality on the 10,219 first turns: lab/testbed_quality_run.sh with TTQ_VARIANT (default
#            steps_1400: the cosine schedule ending at step 1,400), alone on the GPU, the held-out curve every 200
#            steps, τ of the export in vLLM on MT-bench; ~10 min. TTQ_WARM=1 compiles beside the answering (off:
#            on one H100 the warm-up took 170 s against 63 s of answering, lab/NOTEBOOK.md); TORCH_LOGS=recompiles
#            (TTQ_TORCH_LOGS) puts every recompilation and its reason in the training's log; TTQ_LIVE_STEPS
#            (e.g. "1200 1600 2000" with TTQ_VARIANT=default, the 3-epoch schedule) serves those checkpoints in
#            vLLM too, for the first that reaches each live τ (testbed_quality_run.sh's LIVE_STEPS); TTQ_EVAL_EVERY
#            (default 200, the curve's resolution; the recipe's own is 500) sets the held-out evaluations' spacing;
#            TTQ_L_EVAL=SECONDS (default 0: none) measures the export's live chain τ in `dflashkit eval` too, after
#            vLLM (the DFlash side of a DFlash2 comparison on the same answers: REGEN2=$RUN/ttq/regen.jsonl);
#            TTQ_MORE=KEY=VALUE,... adds recipe overrides (e.g. muon_ns_dtype=bfloat16; a second form with its own RUN);
#   pairs    DFlash2's training throughput beside DFlash's, both in one process on the same batches
#            (bench/bench_train_throughput.py --drafter-architecture dflash,dflash2 --smollm2-shape, offline, 12
#            steps), once per form of PAIR_FORMS (default "plain both conv": no kernel, both kernels, the
#            convolution's alone; "selector": the selector's alone; out/pair_<form>.json); ~2 min a form;
#            PAIR_PROFILE=1 also profiles 3 steps of each architecture, every kernel's time
#            (out/profile_<form>_dflash.txt, out/profile_<form>_dflash2.txt);
#   optim    the recipe's own step (4k tokens, G 1; bench/bench_train_throughput.py --target, offline and online,
#            30 steps) with each optimizer form of OPTIM_FORMS (default "adamw muon_one muon": AdamW; Muon with one
#            matrix per Newton-Schulz stack, as before the stacks; Muon as the recipe runs it, same-shape matrices
#            stacked; also muon_bf16: stacked, Newton-Schulz in bf16; out/optim_<form>.json); ~1 min a form, after
#            the target is there; OPTIM_PROFILE=FORM also profiles 3 online steps of that form
#            (out/profile_optim_FORM.txt: every operator's host time and every kernel's device time);
#   data     the online start-up's data step (lab/bench_encode_data.py: records tokenized together against one
#            record per call, inline and with DATA_WORKERS workers, default "0 4 8", 3 times each) on the regenerated
#            first turns of the ttq stage ($R/ttq/regen.jsonl, or DATA_FILE); out/encode_data.json; ~3 min;
#   dflash2  DFlash2's forms beside DFlash at equal data (first turns, EPOCHS2 epochs, VARIANTS2 side by side),
#            live chain τ of each in `dflashkit eval` (vLLM 0.24 serves no DFlash2); ~25 min, a lease of its own;
#            REGEN2=FILE trains on those answers instead of answering again (e.g. /root/run/ttq/regen.jsonl after ttq);
#            MORE2=conv_kernel=true,selector_kernel=true trains the DFlash2 forms with the kernels; TURNS2=every
#            answers every user turn instead (more data: e.g. VARIANTS2=default,dflash2 MORE2=max_steps=3000);
#            EVAL_HUMANEVAL=1 also walks each export on HumanEval 164 (testbed_quality_run.sh's stage 4);
#   rows     the recipe's rows on every answered turn: every turn answered greedily, and once more sampled
#            (SAMPLED=1) when a row reads the sampled answers (extra_answers, extra_answers_same_steps); then ROWS
#            (default seed_1,extra_answers_same_steps) PAR3 (default 2) at a time for EPOCHS3 (default 2) epochs
#            (3: the recipe's own count, ~1.5x the time; extra_answers_same_steps takes half, rounded down, so
#            its steps equal the others' at an even count only), τ in vLLM of the DFlash rows (vLLM 0.24
#            serves no DFlash2); L_EVAL3=SECONDS also measures every row's live chain τ in `dflashkit eval` on
#            MT-bench, PAR3 at once (EVAL_HUMANEVAL=1 adds HumanEval, a row at a time); each export kept in
#            pieces; a lease of its own (REGEN=FILE skips the greedy answering). The whole schedule takes 9-13
#            min a row alone on one H100, so more than two rows need a lease each pair; MORE=max_steps=N screens
#            them on a shorter schedule instead (e.g. ROWS=default,seed_1,kl,non_causal,extra_answers_same_steps
#            MORE=max_steps=2000 VLLM_SETS=mtbench: ~4 min a row alone, after ~4 min of sampled answering);
# READY=FILE makes the stages that need the target (ttq, optim, dflash2, rows) wait up to 15 minutes for FILE to
# exist: the target and vLLM may still be arriving while the first stages run.
#
#   export PYTHONPATH=$(bash lab/import_path.sh):/tmp/site
#   TARGET=/root/testbed/smollm2-bf16 DATA=/root/data RUN=/root/run bash lab/testbed_quality_lease.sh   # H200
#   SCALE=toy STAGES="kernels pairs ttq" TARGET=testbed:smollm2 DATA=.cache/gpu RUN=/tmp/toy \
#     PYTHON=.venv/bin/python bash lab/testbed_quality_lease.sh                                   # CPU twin
#
# The toy scale runs the stages on the CPU (the kernels' benchmark on torch alone at 512 positions, the pair at
# the toy shape, the quality runs at their toy scale): a check that they fit together, not a measurement.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-/root/data}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
STAGES=${STAGES:-kernels pairs ttq}
absolute() { [ -e "$1" ] && echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" || echo "$1"; }
T=$(absolute "$T")
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; note(), stage()
if [ "$SCALE" = toy ]; then
  PAIR=(--toy --device cpu --steps 2 --warmup 1); SELECTOR=(--positions 512); CONV=(--blocks 32)
  PAIR_FORMS=${PAIR_FORMS:-both plain}
  OPTIM=(--toy --device cpu --steps 2 --warmup 1 --modes offline,online)
  ENCODE=(--workers ${DATA_WORKERS:-0} --repeats 1)
else
  PAIR=(--smollm2-shape --steps 12); SELECTOR=(); CONV=(--sweep)
  PAIR_FORMS=${PAIR_FORMS:-plain both conv}
  OPTIM=(--target "$T" --micro-batch-tokens 4096 --grad-accum 1 --steps 30 --warmup 5 --modes offline,online)
  ENCODE=(--workers ${DATA_WORKERS:-0 4 8} --repeats 3)
fi
OPTIM_FORMS=${OPTIM_FORMS:-adamw muon_one muon}
pair_flags() {  # FORM: the kernel flags of a pair form (PAIR_FORMS above) in FLAGS; 1 for an unknown form
  case $1 in
    plain) FLAGS=() ;; both) FLAGS=(--selector-kernel --conv-kernel) ;;
    conv) FLAGS=(--conv-kernel) ;; selector) FLAGS=(--selector-kernel) ;;
    *) return 1 ;;
  esac
}
optim_flags() {  # FORM: the optimizer flags of an optim form (OPTIM_FORMS above) in FLAGS; 1 for an unknown form
  case $1 in
    adamw) FLAGS=(--optimizer adamw) ;; muon) FLAGS=(--optimizer muon) ;;
    muon_one) FLAGS=(--optimizer muon --muon-stack-bytes 0) ;;
    muon_bf16) FLAGS=(--optimizer muon --muon-ns-dtype bfloat16) ;;
    *) return 1 ;;
  esac
}
# a misspelt stage or pair form is refused before any stage runs, not after the ones before it
for s in $STAGES; do
  case $s in
    kernels|ttq|pairs|optim|data|dflash2|rows) ;;
    *) note "unknown stage $s (kernels, ttq, pairs, optim, data, dflash2, rows)"; exit 2 ;;
  esac
done
if [[ " $STAGES " == *" pairs "* ]]; then
  for form in $PAIR_FORMS; do
    pair_flags "$form" || { note "unknown pair form $form (plain, both, conv, selector)"; exit 2; }
  done
fi
if [[ " $STAGES " == *" optim "* ]]; then
  for form in $OPTIM_FORMS; do
    optim_flags "$form" || { note "unknown optim form $form (adamw, muon_one, muon, muon_bf16)"; exit 2; }
  done
fi
ready() {  # the target's stages wait for READY (above)
  [ -z "${READY:-}" ] && return 0
  local i
  for i in $(seq 180); do [ -e "$READY" ] && return 0; sleep 5; done
  note "$1: $READY did not appear within 15 minutes: skipped"; return 1
}
quality() {  # NAME LIMIT ENV...: lab/testbed_quality_run.sh over $R/NAME with the stage's settings
  local name=$1 limit=$2; shift 2
  ready "$name" || return 1
  stage "$name" "$limit" env "$@" TARGET="$T" DATA="$D" RUN="$R/$name" SCALE="$SCALE" PYTHON="$PY" \
    bash "$ROOT/lab/testbed_quality_run.sh"
}
note "start: scale $SCALE, stages $STAGES, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)"
for s in $STAGES; do
  case $s in
  kernels)
    if [ "$SCALE" != toy ]; then  # on a CPU the test skips itself: the kernels need CUDA
      stage kernels-test 300 "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -k cuda \
        "$ROOT/tests/unit/train/test_train_selector_pair.py" "$ROOT/tests/unit/train/test_train_dynamic_conv.py" \
        "$ROOT/tests/unit/train/test_train_packing.py" "$ROOT/tests/unit/train/test_train_gpu.py" \
        "$ROOT/tests/integration/test_train_eval_consistency.py"
    fi
    (stage kernels-bench 300 "$PY" -m lab.bench_selector_pair "${SELECTOR[@]}" \
      --out "$O/selector_pair.json")
    (stage conv-bench 300 "$PY" -m lab.bench_dynamic_conv "${CONV[@]}" \
      --out "$O/dynamic_conv.json") ;;
  ttq)
    quality ttq 1500 WARM="${TTQ_WARM:-0}" TORCH_LOGS="${TTQ_TORCH_LOGS:-recompiles}" TURNS=first \
      VARIANTS="${TTQ_VARIANT:-steps_1400}" PAR=1 EVAL_EVERY="${TTQ_EVAL_EVERY:-200}" L_EVAL="${TTQ_L_EVAL:-0}" \
      L_TRAIN=420 KS=15 KEEP_DRAFTER=1 VLLM_SETS=mtbench LIVE_STEPS="${TTQ_LIVE_STEPS:-}" MORE="${TTQ_MORE:-}" ;;
  pairs)
    for form in $PAIR_FORMS; do
      pair_flags "$form"
      [ "${PAIR_PROFILE:-0}" = 1 ] && FLAGS+=(--profile "$O/profile_$form.txt")
      (stage "pair-$form" 400 "$PY" -m bench.bench_train_throughput "${PAIR[@]}" \
        --drafter-architecture dflash,dflash2 --modes offline "${FLAGS[@]}" --out "$O/pair_$form.json")
    done ;;
  optim)
    ready optim || continue
    for form in $OPTIM_FORMS; do
      optim_flags "$form"
      [ "${OPTIM_PROFILE:-}" = "$form" ] && FLAGS+=(--profile "$O/profile_optim_$form.txt")
      (stage "optim-$form" 400 "$PY" -m bench.bench_train_throughput "${OPTIM[@]}" "${FLAGS[@]}" \
        --out "$O/optim_$form.json")
    done ;;
  data)
    ready data || continue
    (stage data 600 "$PY" -m lab.bench_encode_data --data "${DATA_FILE:-$R/ttq/regen.jsonl}" \
      --target "$T" "${ENCODE[@]}" --out "$O/encode_data.json") ;;
  dflash2)
    quality dflash2 3000 TURNS="${TURNS2:-first}" REGEN="${REGEN2:-}" \
      VARIANTS="${VARIANTS2:-default,dflash2,dflash2_coupled,dflash2_codebook_lr,dflash2_injected}" \
      EPOCHS="${EPOCHS2:-2}" L_TRAIN="${L_TRAIN2:-1000}" L_EVAL="${L_EVAL2:-300}" VLLM_SETS= MORE="${MORE2:-}" ;;
  rows)
    ROWS=${ROWS:-seed_1,extra_answers_same_steps}
    SAMPLED=0; [[ ",$ROWS" == *,extra_answers* ]] && SAMPLED=1  # the sampled answers only for a row that reads them
    quality rows 4000 SAMPLED=$SAMPLED TURNS=every VARIANTS="$ROWS" PAR="${PAR3:-2}" EPOCHS="${EPOCHS3:-2}" \
      L_TRAIN="${L_TRAIN3:-1500}" L_EVAL="${L_EVAL3:-0}" KEEP_DRAFTER=1 ;;
  esac
done
note "all done"
