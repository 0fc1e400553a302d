"""lab/testbed_causal_run.sh, the one-GPU script of the serving plan's first question, run at its CPU scale
(SCALE=toy) on the SmolLM2 testbed: regeneration, the default and the causal-in-block layouts trained side by
side, and vLLM's CPU stand-in (tests/support/vllm_standin.py) serving both exports at two numbers of speculative tokens.
A check that the stages fit together, not a measurement."""

import json

import pytest

from support.run_scripts import run_toy_script, toy_data


@pytest.mark.slow
def test_the_causal_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt=6, mtbench=3)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_causal_run.sh", run, limits=("L_TRAIN", "L_VLLM", "L_EVAL"),
                          TARGET="testbed:smollm2", DATA=str(data))
    assert {"regenerate", "train-layouts", "vllm-tau-k"} <= set(ends), ends
    rows = json.loads((run / "out" / "layouts" / "results.json").read_text())["variants"]
    assert {name: rows[name]["status"] for name in ("non_causal", "causal")} == {"non_causal": "trained",
                                                                                 "causal": "trained"}
    for name, causal in (("non_causal", None), ("causal", True)):  # the layout reached the export
        config = json.loads((run / "work" / "train" / name / "export" / "config.json").read_text())
        assert config.get("is_causal") is causal and config["dflash_config"].get("causal") is causal
    served = json.loads((run / "out" / "vllm" / "g_tau_per_k.json").read_text())
    cells = {(row["drafter"], row["k"]): row for row in served["rows"]}
    assert set(cells) == {(d, k) for d in ("non_causal", "causal") for k in (1, 3)}
    for row in cells.values():  # each engine drafted, with k positions per draft
        assert row["drafts"] > 0 and 1.0 <= row["tau"] <= 1 + row["k"]
        assert len(row["per_position_acceptance"]) == row["k"]
