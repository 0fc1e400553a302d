#!/usr/bin/env bash
# One H200 session for the target in vLLM (issue 37 item 4; lab/NOTEBOOK.md / lab/BENCHMARKS.md "Features from vLLM"): the
# features vLLM captures against Hugging Face's, how fast each captures, a drafter trained from each, and the
# memory the training process keeps. Stages, in order of what the issue's goals need first (a stage's JSON is in
# $RUN/out as soon as it ends; each stage within the 10-minute limit of one command):
#   1. capture-testbed: lab/bench_capture_vllm.py --parts equality throughput --shapes target: the testbed's
#      shards from `dflashkit extract --engine vllm` and `--engine hf` compared per tap, `dflashkit verify`,
#      features/s of both engines (~2 min);
#   2. capture-8b: the same throughput on a random-weight Qwen3-8B-shaped target (vLLM load_format="dummy";
#      goal vllm / hf >= 1.5) (~5 min);
#   3. the first user turn of every testbed ShareGPT conversation answered by the target (~1 min);
#   4. online-hf, online-vllm: lab/bench_online_vllm.py, one path per command, the recipe for ONLINE_EPOCHS
#      epoch(s) on those turns, then `dflashkit eval` chain on MT-bench 80 (~5.5 and ~6.5 min);
#   5. capture-8b-mem: the training process's GPU memory with the 8B target in vLLM vs a Hugging Face replica;
#   6. capture-reference: Hugging Face in float32 as the reference both bf16 engines' testbed shards (stage 1's,
#      or extracted anew) are measured against: whether vLLM differs from HF by bf16 rounding alone (~2 min).
# STAGES picks what runs, in that order (default "capture online memory reference"): e.g. STAGES=online for the
# two drafters alone.
#
#   .venv/bin/python -m lab.bench_capture_vllm --write-data .cache/gpud/sharegpt256.jsonl --samples 256  # here
#   TARGET=/root/testbed/smollm2-bf16 DATA=/root/data RUN=/root/run bash lab/testbed_capture_run.sh        # H200
#   SCALE=toy RUN=/tmp/toy_capture PYTHON=.venv/bin/python bash lab/testbed_capture_run.sh           # CPU twin
#
# DATA holds sharegpt256.jsonl (the capture samples), sharegpt.jsonl(.gz) and mtbench.jsonl (lab/testbed_data.py).
# The toy scale runs every stage with --standin (vLLM's capture replaced by tests/support/vllm_capture_standin.py, a toy
# target, synthetic chats, the CPU): a check that the stages fit together, not a measurement.
set -u
T=${TARGET:-/root/testbed/smollm2-bf16}
D=${DATA:-.cache/gpud}
R=${RUN:-/root/run}
SCALE=${SCALE:-full}
ONLINE_EPOCHS=${ONLINE_EPOCHS:-1}
STAGES=" ${STAGES:-capture online memory reference} "
mkdir -p "$D"
. "$(dirname "$0")/run_lib.sh"  # ROOT, D, R, O, PY; the shell in $R; stage()
if [ "$SCALE" = toy ]; then
  CAP=(--standin); ONLINE=(--standin); L_STAGE=${L_STAGE:-600}
else
  CAP=(--target "$T" --data "$D/sharegpt256.jsonl"); L_STAGE=${L_STAGE:-600}
  ONLINE=(--target "$T" --data "$R/regen.jsonl" --dataset "$D/mtbench.jsonl" --epochs "$ONLINE_EPOCHS")
  DEV=(); SLOTS=2048; NEW=256; LIMIT=()
fi
VENV=(bash "$ROOT/lab/vllm_env.sh" "$PY")  # the slim vLLM's environment (../shared/vllm/README.md)
echo "[$(date +%T)] start: scale $SCALE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)" >> "$R/stages.txt"

capture() {  # NAME OUT PARTS SHAPE [WORK]: one bench_capture_vllm.py command (work dir $R/WORK, default capture-NAME)
  stage "$1" "$L_STAGE" "${VENV[@]}" -m lab.bench_capture_vllm --parts $3 --shapes "$4" "${CAP[@]}" \
    --work-dir "$R/${5:-capture-$1}" --out "$O/$2"
}

wants() { [[ $STAGES == *" $1 "* ]]; }

# --- 1-2. features from vLLM against Hugging Face's: equality, features/s ---------------------------------------------
if wants capture; then
  capture capture-testbed capture_testbed.json "equality throughput" target
  capture capture-8b capture_8b.json throughput qwen3-8b
fi

# --- 3-4. a drafter trained online from each engine's features --------------------------------------------------------
if wants online; then
  [ "$SCALE" = toy ] || first_turns
  for path in hf vllm; do
    stage "online-$path" "$L_STAGE" "${VENV[@]}" -m lab.bench_online_vllm --paths "$path" "${ONLINE[@]}" \
      --work-dir "$R/online" --out "$O/online_vllm.json"
  done
fi

# --- 5. the training process's memory at the 8B shape -----------------------------------------------------------------
wants memory && capture capture-8b-mem capture_8b_mem.json memory qwen3-8b

# --- 6. bf16 against a float32 reference (reuses stage 1's shards: the same --work-dir) -------------------------------
wants reference && capture capture-reference capture_reference.json reference target capture-capture-testbed
echo "[$(date +%T)] all done" >> "$R/stages.txt"
