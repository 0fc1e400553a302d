"""lab/testbed_engine_run.sh, the one-GPU script of the engine study, run at its CPU scale (SCALE=toy) on the
SmolLM2 testbed: regeneration, DFlash and DFlash2 trained and evaluated, vLLM's CPU stand-in serving a toy pair
(support/vllm_standin.py), tau in the engine against `dflashkit eval` on the same pair, and the projection model. A
check that the stages fit together, not a measurement."""

import json

import pytest

from support.run_scripts import run_toy_script, toy_data


@pytest.mark.slow
def test_the_engine_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt=6, mtbench=3, humaneval=3)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_engine_run.sh", run, limits=("L_TRAIN", "L_TRAIN2", "L_EVAL"),
                          TARGET="testbed:smollm2", DATA=str(data))
    assert {"regenerate", "train-dflash", "vllm-serve", "train-dflash2", "eval-dflash", "eval-dflash2", "toy-eval",
            "vllm-tau"} <= set(ends), ends

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
