"""lab/testbed_recipe_run.sh, the one-GPU script of the recipe study, run at its CPU scale (SCALE=toy) on the
SmolLM2 testbed (a random tiny target answers with empty text, which leaves nothing to train on): every stage a GPU
session runs (regeneration greedy and sampled, the screen with a seed replicate, the 3-epoch row beside it, the
combination of winners) is a real command here, in the order and with the files the GPU run uses. A check that the
stages fit together, not a measurement."""

import json

import pytest

from support.run_scripts import run_toy_script, toy_data


@pytest.mark.slow
def test_the_recipe_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt=6, mtbench=3)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_recipe_run.sh", run, limits=("L_SCREEN", "L_FULL", "L_EVAL"),
                          TARGET="testbed:smollm2", DATA=str(data), TOY_SCREEN="default,seed_1,adamw",
                          FULL="default", EXTRA_ROW="1", COMBINE="1")
    expected = {"regenerate", "regenerate-sampled", "study-extra", "study-full", "study-screen", "study-full-combo"}
    assert set(ends) == expected, ends
    assert all((run / "out" / f"{name}.log").is_file() for name in ends)  # each stage's log copied out as it ends
    stages = (run / "stages.txt").read_text()

    # the regenerations answered the prompts: greedy and sampled, one conversation per prompt
    greedy = [json.loads(x) for x in (run / "regen.jsonl").read_text().splitlines()]
    sampled = [json.loads(x) for x in (run / "regen_s1.jsonl").read_text().splitlines()]
    assert len(greedy) == len(sampled) == 6
    assert f"regenerated conversations: {len(greedy)}" in stages and f"sampled conversations: {len(sampled)}" in stages

    def rows(name):
        return json.loads((run / "out" / name / "results.json").read_text())["variants"]

    screen = rows("screen")
    assert set(screen) == {"default", "seed_1", "adamw"}  # in the order the parallel rows were recorded
    assert screen["seed_1"]["overrides"] == ["seed=1"] and screen["adamw"]["overrides"] == ["optimizer=adamw"]
    done = [("screen", name) for name in screen] + [("full", "default"), ("extra", "extra_answers")]
    for study, name in done:
        row = rows(study)[name]
        assert row["status"] == "done" and 1 <= row["step"] <= 2, (study, name, row)  # the toy's max_steps=2
        # tau is the eval report's, copied out with the row's train and eval logs
        report = json.loads((run / "out" / study / "results" / name / "report.json").read_text())
        assert row["tau"] == report["overall"]["tau"] >= 1.0
        assert (run / "out" / study / "results" / name / "summary.json").is_file()
    # the extra_answers row trained on both regenerations
    command = (run / "out" / "extra" / "results" / "extra_answers" / "train.log").read_text().splitlines()[0]
    assert f"--data {run / 'regen.jsonl'} --data {run / 'regen_s1.jsonl'}" in command
    # the combination stage read the screen: a combo trained and evaluated if a row beat the default by more than
    # the seed replicate moved it, else the stage says there was nothing to combine
    combine_log = (run / "study-full-combo.log").read_text()
    combo = json.loads((run / "out" / "full-combo" / "results.json").read_text())["variants"] \
        if (run / "out" / "full-combo" / "results.json").is_file() else {}
    margin = max(0.01, abs(screen["seed_1"]["tau"] - screen["default"]["tau"]))
    if screen["adamw"]["tau"] > screen["default"]["tau"] + margin:
        assert combo["combo"]["overrides"] == ["optimizer=adamw"] and combo["combo"]["status"] == "done"
    else:
        assert "nothing to combine" in combine_log and "combo" not in combo
