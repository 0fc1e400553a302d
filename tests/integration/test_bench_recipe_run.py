"""bench/testbed_recipe_run.sh, the one-GPU script of the recipe study, run at its CPU scale (SCALE=toy) on the
SmolLM2 testbed (a random tiny target answers with empty text, which leaves nothing to train on): every stage a GPU
session runs (regeneration greedy and sampled, the screen with a seed replicate, the 3-epoch row beside it, the
combination of winners) is a real command here, in the order and with the files the GPU run uses. A check that the
stages fit together, not a measurement."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.chat_data import chat_records, write_jsonl

SCRIPT = Path(__file__).parents[2] / "bench" / "testbed_recipe_run.sh"


def stage_lines(run: Path) -> dict[str, str]:
    """stage name -> its last 'NAME: rc=N S s' line of stages.txt"""
    ends = {}
    for line in (run / "stages.txt").read_text().splitlines():
        if ": rc=" in line:
            name = line.split("] ", 1)[1].split(":", 1)[0]
            ends[name] = line
    return ends


@pytest.mark.slow
def test_the_recipe_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "sharegpt.jsonl", chat_records(10, seed=1))
    write_jsonl(data / "mtbench.jsonl", chat_records(3, seed=2))
    run = tmp_path / "run"
    env = {**os.environ, "SCALE": "toy", "TARGET": "testbed:smollm2", "DATA": str(data), "RUN": str(run),
           "PYTHON": sys.executable, "TOY_SCREEN": "default,seed_1,muon", "FULL": "default", "EXTRA_ROW": "1",
           "COMBINE": "1",
           # the script's own stage limits, far beyond any toy stage: the test does not depend on timing
           "L_SCREEN": "3600", "L_FULL": "3600", "L_EVAL": "3600"}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=5400)
    stages = (run / "stages.txt").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + stages
    assert stages.rstrip().endswith("all done"), stages
    ends = stage_lines(run)
    expected = {"regenerate", "regenerate-sampled", "study-extra", "study-full", "study-screen", "study-full-combo"}
    assert set(ends) == expected, stages
    for name, line in ends.items():
        assert " rc=0 " in line, f"{name}: {line}\n{(run / f'{name}.log').read_text()[-3000:]}"
        assert (run / "out" / f"{name}.log").is_file()  # each stage's log is copied out as it ends

    # the regenerations answered the prompts: greedy and sampled, one conversation per prompt
    greedy = [json.loads(x) for x in (run / "regen.jsonl").read_text().splitlines()]
    sampled = [json.loads(x) for x in (run / "regen_s1.jsonl").read_text().splitlines()]
    assert len(greedy) == len(sampled) == 10
    assert f"regenerated conversations: {len(greedy)}" in stages and f"sampled conversations: {len(sampled)}" in stages

    def rows(name):
        return json.loads((run / "out" / name / "results.json").read_text())["variants"]

    screen = rows("screen")
    assert list(screen) == ["default", "seed_1", "muon"]
    assert screen["seed_1"]["overrides"] == ["seed=1"] and screen["muon"]["overrides"] == ["optimizer=muon"]
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
    if screen["muon"]["tau"] > screen["default"]["tau"] + margin:
        assert combo["combo"]["overrides"] == ["optimizer=muon"] and combo["combo"]["status"] == "done"
    else:
        assert "nothing to combine" in combine_log and "combo" not in combo
