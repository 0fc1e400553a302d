"""bench/testbed_engine_run.sh, the one-GPU script of the engine study, run at its CPU scale (SCALE=toy) on the
SmolLM2 testbed: regeneration, DFlash and DFlash2 trained and evaluated, vLLM's CPU stand-in serving a toy pair
(eval/vllm_standin.py), tau in the engine against `dflashkit eval` on the same pair, and the projection model. A
check that the stages fit together, not a measurement."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.chat_data import chat_records, write_jsonl

SCRIPT = Path(__file__).parents[2] / "bench" / "testbed_engine_run.sh"


@pytest.mark.slow
def test_the_engine_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "sharegpt.jsonl", chat_records(10, seed=1))
    write_jsonl(data / "mtbench.jsonl", chat_records(3, seed=2))
    write_jsonl(data / "humaneval.jsonl", chat_records(3, seed=3))
    run = tmp_path / "run"
    env = {**os.environ, "SCALE": "toy", "TARGET": "testbed:smollm2", "DATA": str(data), "RUN": str(run),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=5400)
    stages = (run / "stages.txt").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + stages
    assert stages.rstrip().endswith("all done"), stages
    ends = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in stages.splitlines() if ": rc=" in line}
    assert {"regenerate", "train-dflash", "vllm-serve", "train-dflash2", "eval-dflash", "eval-dflash2", "toy-eval",
            "vllm-tau"} <= set(ends), stages
    for name, line in ends.items():
        assert " rc=0 " in line, f"{name}: {line}\n{(run / f'{name}.log').read_text()[-3000:]}"

    for study, variant in (("dflash", "default"), ("dflash2", "dflash2")):
        row = json.loads((run / "out" / study / "results.json").read_text())["variants"][variant]
        report = json.loads((run / "out" / study / "results" / variant / "report.json").read_text())
        assert row["status"] == "done" and row["tau"] == report["overall"]["tau"] >= 1.0, (study, row)
    # the stand-in served the toy pair; its tau is compared with dflashkit eval's on the same pair and prompts
    tau = json.loads((run / "out" / "vllm" / "a_tau.json").read_text())
    assert tau["tau_vllm"] == pytest.approx(tau["tau_dflashkit"]) and tau["drafts"] > 0
    lossless = json.loads((run / "out" / "vllm" / "b_lossless.json").read_text())
    assert lossless["requests"] > 0 and lossless["identical"] == lossless["requests"], lossless  # drafter on = off
    levels = json.loads((run / "out" / "vllm" / "c_concurrency.json").read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]  # the toy scale's --concurrency 1 2
    assert json.loads((run / "out" / "vllm" / "e_projection.json").read_text())["target_shape"]
