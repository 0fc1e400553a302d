"""The plans of lab/plans/ resolved as `python -m lab.lease plan` resolves them: every placeholder filled in every
profile, every `-m` module importable here, every setup step a stage waits for defined, and the engine026 plan run
through at its toy profile on the CPU (a check that its stages fit together, not a measurement)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from lab.lease import main
from lab.lease_files import records
from lab.plan_file import PLACEHOLDER, load_plan

from support.run_scripts import toy_data

PLANS = sorted((Path(__file__).parents[1] / "plans").glob("*.yaml"))
CASES = [(p, profile) for p in PLANS for profile in [None, *(yaml.safe_load(p.read_text()).get("profiles") or {})]]


def test_the_lab_has_the_plans_of_its_runs():
    assert {p.name for p in PLANS} >= {"engine026.yaml", "schedule.yaml"}


@pytest.mark.parametrize("path, profile", CASES, ids=[f"{p.stem}-{prof or 'full'}" for p, prof in CASES])
def test_a_plan_resolves_every_placeholder_and_names_only_modules_that_exist(path, profile):
    plan = load_plan(path, {"data": "/data"}, profile)
    if plan.replaces:  # a plan written for a new run replaces no script
        replaced = Path(__file__).parents[2] / plan.replaces
        assert replaced.is_file(), f"{path.name}: replaces {plan.replaces}, which is not in the checkout"
    modules = []
    for stage in plan.stages:
        for item in stage.argv:
            assert not PLACEHOLDER.search(item), f"{path.name} {stage.name}: {item!r} left unfilled"
        modules += [stage.argv[i + 1] for i, item in enumerate(stage.argv[:-1]) if item == "-m"]
        assert stage.limit > 0
    assert modules, f"{path.name}: no stage runs a module"
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"{path.name}: no module {module}"
    for text in [s.command for s in plan.setup] + [s.done for s in plan.setup] + plan.collect:
        assert not PLACEHOLDER.search(text), text


# the whole toy lease takes ~4-5 min on two shared cores, the same work as test_engine026_lease.py (the script's
# toy test): it runs where LAB_LEASE_TOY=1 is set, and takes that test's place when the script is retired
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LAB_LEASE_TOY"), reason="set LAB_LEASE_TOY=1 (a ~5 min toy lease)")
def test_the_engine026_plan_runs_every_stage_at_toy_scale(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = toy_data(tmp_path / "data", sharegpt=8, mtbench=2)
    run = tmp_path / "run"
    plan = str(PLANS[0].parent / "engine026.yaml")
    assert main(["run", plan, "--profile", "toy", "--set", f"data={data}", "--set", f"run={run}",
                 "--set", f"python={sys.executable}"]) == 0, (run / "stages.jsonl").read_text()
    assert {name: r["status"] for name, r in records(run).items()} == {
        s: "ok" for s in ("regenerate", "train", "export", "serve-024", "serve-026", "chain", "compare", "grid")}
    compare = json.loads((run / "compare" / "compare.json").read_text())
    assert set(compare["releases"]) == {"0.24", "0.26"} and compare["missing"] == []
    assert compare["drafter_outputs_between_releases"]["prompts"] == 2
    grid = json.loads((run / "grid" / "report" / "report.json").read_text())
    assert sorted(grid["ks"]) == [1, 3]
    archive = tmp_path / "results.tar.gz"
    assert main(["collect", str(run), str(archive)]) == 0 and archive.stat().st_size < 16 * 2**20
