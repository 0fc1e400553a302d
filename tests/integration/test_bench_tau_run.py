"""bench/testbed_tau_run.sh, the testbed run of RESULTS.md (every turn regenerated, dpace and ce trained at equal
steps, the chain and tree evaluations), run at its CPU scale (SCALE=toy, DEVICE=cpu) on the SmolLM2 testbed: its
two-process stages run as two CPU processes (gloo), every other stage as on the GPU. A check that the stages fit
together, not a measurement."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.chat_data import chat_records, write_jsonl

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_tau_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "sharegpt_turns.jsonl", chat_records(12, seed=1))
    write_jsonl(data / "mtbench.jsonl", chat_records(3, seed=2))
    write_jsonl(data / "humaneval.jsonl", chat_records(3, seed=3))
    run = tmp_path / "run"
    # the script runs `python`, `torchrun` and `python -m dflashkit` from PATH, from the checkout's root
    env = {**os.environ, "SCALE": "toy", "DEVICE": "cpu", "TARGET": "testbed:smollm2", "DATA": str(data),
           "RUN": str(run), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           # the script's own stage limits, far beyond any toy stage: the test does not depend on timing
           **{k: "3600" for k in ("L_REGEN", "L_TRAIN", "L_TRAIN_LONG", "L_EVAL", "L_EVAL_SMALL")}}
    proc = subprocess.run(["bash", "bench/testbed_tau_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=5400)
    stages = (run / "stages.txt").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + stages
    assert stages.rstrip().endswith("all done"), stages
    ends = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in stages.splitlines() if ": rc=" in line}
    assert {"regenerate", "train-dpace", "train-ce", "eval-main", "eval-dpace-6", "eval-ce-6"} <= set(ends), stages
    for name, line in ends.items():
        assert " rc=0 " in line, f"{name}: {line}\n{(run / f'{name}.log').read_text()[-3000:]}"

    regen = [json.loads(x) for x in (run / "regen.jsonl").read_text().splitlines()]
    assert len(regen) == 12  # every conversation answered, by two processes
    for objective in ("dpace", "ce"):  # equal steps: both exported at the same checkpoint and evaluated
        report = json.loads((run / f"eval-{objective}-6" / "report.json").read_text())
        assert report["overall"]["tau"] >= 1.0 and (run / f"drafter-{objective}-6" / "config.json").is_file()
    rows = json.loads((run / "bench_eval.json").read_text())["rows"]
    assert {(r["mode"], Path(r["dataset"]).name) for r in rows} >= {("chain", "mtbench.jsonl"),
                                                                   ("chain", "humaneval.jsonl")}
    assert all(r["mismatches"] == 0 for r in rows)  # lossless against the target's own greedy decoding
