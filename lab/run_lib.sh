# Shared by the one-GPU run scripts (lab/testbed_engine_run.sh, lab/testbed_recipe_run.sh,
# lab/testbed_causal_run.sh, lab/testbed_schedule_run.sh, lab/testbed_quality_run.sh,
# lab/testbed_quality_lease.sh): sourced, not run.
# Takes D (data dir) and R (run dir) as the caller set them; leaves ROOT (the checkout), D, R and O ($R/out)
# absolute, PY (PYTHON, default python3, absolute when given as a path), the shell in $R, and note() and stage().
# Every command runs from the run directory, the bench and lab scripts as modules (`"$PY" -m lab.X`): `python -m ...`
# from the checkout's root would import its dflashkit/ folder (the command and version only) where dflashkit is put
# on PYTHONPATH rather than installed (lab/import_path.sh).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$R/out"
D=$(cd "$D" && pwd)
R=$(cd "$R" && pwd)
O=$R/out
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
cd "$R" || exit 1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# bench/ and lab/ importable as packages (`"$PY" -m lab.recipe_study`) through a folder of links to them alone: the
# checkout's root itself on the path would put its dflashkit/ folder before an installed dflashkit; tests/ too, as
# from the checkout's root, for the CPU twins of vLLM that the toy scale serves with (tests.support, lab/standin_*.py)
mkdir -p "$R/.packages" && ln -sfn "$ROOT/bench" "$R/.packages/bench" && ln -sfn "$ROOT/lab" "$R/.packages/lab"
ln -sfn "$ROOT/tests" "$R/.packages/tests"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$R/.packages

note() { echo "[$(date +%T)] $*" >> "$R/stages.txt"; }  # a line of the run's log

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

first_turns() {  # the first user turn of every conversation of $D/sharegpt.jsonl answered by the target ($T) into
  # $R/regen.jsonl, unless there; takes NEW (new tokens), SLOTS, and the arrays DEV and LIMIT from the caller
  if [ ! -s "$R/regen.jsonl" ]; then
    [ -f "$D/sharegpt.jsonl" ] || gunzip -k "$D/sharegpt.jsonl.gz"
    stage regenerate 420 "$PY" -m dflashkit.extract.regenerate --target "$T" --data "$D/sharegpt.jsonl" \
      --out "$R/regen.jsonl" --max-turns 1 --max-new-tokens "$NEW" --batch-size "$SLOTS" --max-prompt-length 1024 \
      --no-progress "${DEV[@]}" "${LIMIT[@]}"
  fi
  echo "regenerated conversations: $(wc -l < "$R/regen.jsonl")" >> "$R/stages.txt"
}
