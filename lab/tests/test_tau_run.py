"""lab/testbed_tau_run.sh, the testbed run of lab/NOTEBOOK.md (every turn regenerated, dpace and ce trained at equal
steps, the chain and tree evaluations), run at its CPU scale (SCALE=toy, DEVICE=cpu) on the SmolLM2 testbed: its
two-process stages run as two CPU processes (gloo), every other stage as on the GPU. A check that the stages fit
together, not a measurement."""

import json
from pathlib import Path

import pytest

from support.run_scripts import run_toy_script, toy_data


@pytest.mark.slow
def test_the_tau_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt_turns=6, mtbench=3, humaneval=3)
    run = tmp_path / "run"
    # the script runs `python`, `torchrun` and `python -m dflashkit` from PATH, from the checkout's root
    ends = run_toy_script("testbed_tau_run.sh", run, TARGET="testbed:smollm2", DEVICE="cpu", DATA=str(data),
                          limits=("L_REGEN", "L_TRAIN", "L_TRAIN_LONG", "L_EVAL", "L_EVAL_SMALL"))
    assert {"regenerate", "train-dpace", "train-ce", "eval-main", "eval-dpace-6", "eval-ce-6"} <= set(ends), ends

    regen = [json.loads(x) for x in (run / "regen.jsonl").read_text().splitlines()]
    assert len(regen) == 6  # every conversation answered (the toy's LIMIT_CONV), by two processes
    for objective in ("dpace", "ce"):  # equal steps: both exported at the same checkpoint and evaluated
        report = json.loads((run / f"eval-{objective}-6" / "report.json").read_text())
        assert report["overall"]["tau"] >= 1.0 and (run / f"drafter-{objective}-6" / "config.json").is_file()
    rows = json.loads((run / "bench_eval.json").read_text())["rows"]
    assert {(r["mode"], Path(r["dataset"]).name) for r in rows} >= {("chain", "mtbench.jsonl"),
                                                                   ("chain", "humaneval.jsonl")}
    assert all(r["mismatches"] == 0 for r in rows)  # lossless against the target's own greedy decoding
