"""lab/testbed_engine026_lease.sh at its CPU scale (SCALE=toy) on the SmolLM2 testbed: the recipe trained online
and exported for vLLM, served by the CPU twin of vLLM following 0.24 then 0.26 with per-prompt outputs, walked by
`dflashkit eval --mode chain`, the comparison JSON, and the 0.26 schedule grid. A check that the stages fit
together, not a measurement."""

import json

import pytest

from support.run_scripts import run_toy_script, toy_data


@pytest.mark.slow
def test_the_engine026_lease_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt=8, mtbench=2)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_engine026_lease.sh", run, TARGET="testbed:smollm2", DATA=str(data),
                          STAGES="train serve chain compare grid")
    assert set(ends) == {"train", "export", "serve-024", "serve-026", "chain", "compare", "grid"}, ends

    # each release served the same export at k = 3 (the toy's block of 4), and says which release it was
    for release in ("024", "026"):
        report = json.loads((run / "serve" / f"v{release}" / "report.json").read_text())
        assert report["versions"]["vllm"] == f"0.{release[1:]}.0 (CPU stand-in)"
        assert report["drafter"]["path"] == str(run / "train" / "drafter") and report["num_speculative_tokens"] == 3
        assert len((run / "serve" / f"v{release}" / "outputs.jsonl").read_text().splitlines()) == 2

    compare = json.loads((run / "compare" / "compare.json").read_text())
    assert set(compare["releases"]) == {"0.24", "0.26"} and compare["missing"] == []
    rows = compare["releases"]
    assert rows["0.24"]["vllm"].startswith("0.24") and rows["0.26"]["vllm"].startswith("0.26")
    assert all(r["requests"] == 2 and 0 <= r["identical_with_and_without_drafter"] <= 2 for r in rows.values())
    # the recipe's drafter is full attention and causal in the block: both releases serve it alike
    assert compare["tau_between_releases"]["relative_difference"] == 0.0
    assert compare["drafter_outputs_between_releases"] == {"prompts": 2, "identical": 2, "differing": []}
    chain = json.loads((run / "chain" / "report" / "report.json").read_text())
    assert compare["dflashkit_eval"]["tau"] == chain["overall"]["tau"] >= 1.0

    # the grid: k 1 and 3 measured on 0.26, the schedule derived from them and served on the V2 runner
    grid = json.loads((run / "grid" / "report" / "report.json").read_text())
    assert sorted(grid["ks"]) == [1, 3] and "schedule" in grid["engines"]
    assert grid["schedule"]["runner"].startswith("vLLM 0.26")
