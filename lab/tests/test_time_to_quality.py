"""lab/time_to_quality.py: the wall time to a held-out τ from metrics.jsonl, resumed segments added up, and the
calibration of τ_walk against live τ; and the trainer writes the elapsed_s it reads."""

import json
import subprocess
import sys

import pytest

from lab import time_to_quality as ttq

from support.paths import ROOT


def test_time_to_each_tau_adds_resumed_segments():
    rows = [{"step": 10, "elapsed_s": 50.0, "train/loss": 3.0},
            {"step": 20, "elapsed_s": 100.0, "eval/tau_walk": 1.5},
            {"step": 30, "elapsed_s": 150.0, "eval/tau_walk": 1.8},  # the first process ends after this row
            {"step": 40, "elapsed_s": 40.0, "eval/tau_walk": 2.1},  # resumed: its clock starts again
            {"step": 50, "elapsed_s": 90.0, "eval/tau_walk": 2.3}]
    out = ttq.summarise(rows, [1.7, 2.0, 3.0], {}, offset_s=10.0)
    assert [p["seconds"] for p in out["timeline"]] == [110.0, 160.0, 200.0, 250.0]
    assert out["taus"] == {"1.7": {"step": 30, "seconds": 160.0}, "2.0": {"step": 40, "seconds": 200.0}, "3.0": None}
    assert out["final"] == {"step": 50, "seconds": 250.0, "tau_walk": 2.3}
    # live tau measured at two checkpoints: live = 0.5 * walk + 0.75 through (1.8, 1.65) and (2.3, 1.9)
    cal = ttq.summarise(rows, [1.7], {30: 1.65, 50: 1.9})
    assert cal["calibration"]["a"] == pytest.approx(0.5) and cal["calibration"]["b"] == pytest.approx(0.75)
    assert cal["live_taus"]["1.7"]["tau_walk"] == pytest.approx(1.9)
    assert cal["live_taus"]["1.7"]["reached"] == {"step": 40, "seconds": 190.0}
    # measured, not modelled: the first checkpoint whose live tau reached the threshold
    assert cal["live_reached"] == {"1.7": {"step": 50, "seconds": 240.0, "live": 1.9}}
    assert ttq.summarise(rows, [2.0], {30: 1.65, 50: 1.9})["live_reached"] == {"2.0": None}
    assert ttq.calibration([(2.0, 1.5)]) == (0.75, 0.0)  # one pair: the ratio
    assert "does not rise" in ttq.summarise(rows, [1.7], {30: 1.9, 50: 1.6})["live_taus"]["skipped"]
    with pytest.raises(SystemExit, match=r"--live steps \[35\] have no held-out evaluation"):
        ttq.summarise(rows, [1.7], {35: 1.6})
    with pytest.raises(SystemExit, match="no row has elapsed_s"):
        ttq.timeline([{"step": 1, "eval/tau_walk": 1.2}], "old/metrics.jsonl")


def test_the_tracker_logs_elapsed_time(tmp_path):
    from dflashkit.train.tracking import Tracker, read_metrics

    tracker = Tracker(tmp_path, {}, enabled=True, wandb=False, wandb_project="", run_name="", tensorboard=False,
                      started=1000.0)
    tracker.log({"eval/tau_walk": 1.9}, 5)
    tracker.close()
    (row,) = read_metrics(tmp_path)
    assert row["elapsed_s"] == pytest.approx(row["wall_time"] - 1000.0) and row["elapsed_s"] > 0
    done = subprocess.run([sys.executable, "-m", "lab.time_to_quality", str(tmp_path), "--taus",
                           "1.5", "--out", str(tmp_path / "t.json")], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    assert "wrote" in done.stdout
    result = json.loads((tmp_path / "t.json").read_text())[str(tmp_path)]
    assert result["taus"]["1.5"]["step"] == 5


def test_live_tau_per_run_from_the_engines_results(tmp_path):
    """--live-from: each run's pairs from bench_vllm.py's g_tau_per_k.json (<run>_step<N>: the checkpoint of step
    N; <run>: the export, at the step summary.json gives; the largest k of each), not one set for every run; a
    measured step without a held-out evaluation is listed apart, and another run's rows pair with nothing."""
    runs = {}
    for name, walks in (("default", {20: 1.5, 40: 2.1, 50: 2.3}), ("other", {20: 1.2, 50: 1.4})):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "elapsed_s": 10.0 * s, "eval/tau_walk": w} for s, w in walks.items()]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "summary.json").write_text(json.dumps({"step": 50}))
        runs[name] = run
    vllm = {"rows": [{"drafter": "default_step20", "k": 15, "tau": 1.3},
                     {"drafter": "default_step40", "k": 7, "tau": 1.6},
                     {"drafter": "default_step40", "k": 15, "tau": 1.8},  # the largest k is the one read
                     {"drafter": "default_step30", "k": 15, "tau": 1.7},  # no held-out evaluation at step 30
                     {"drafter": "default", "k": 15, "tau": 2.0},  # the export: step 50 (summary.json)
                     {"drafter": "elsewhere", "k": 15, "tau": 9.9}]}
    (tmp_path / "g.json").write_text(json.dumps(vllm))
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, "-m", "lab.time_to_quality", str(runs["default"]),
                    str(runs["other"]), "--taus", "1.7", "2.0", "--live-from", str(tmp_path / "g.json"),
                    "--out", str(out)], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())
    mine, other = result[str(runs["default"])], result[str(runs["other"])]
    assert [(p["step"], p["live"]) for p in mine["calibration"]["pairs"]] == [(20, 1.3), (40, 1.8), (50, 2.0)]
    assert mine["live_unpaired"] == {"30": 1.7}
    assert mine["live_reached"] == {"1.7": {"step": 40, "seconds": 400.0, "live": 1.8},
                                    "2.0": {"step": 50, "seconds": 500.0, "live": 2.0}}
    assert "calibration" not in other and "live_unpaired" not in other
    both = subprocess.run([sys.executable, "-m", "lab.time_to_quality", str(runs["default"]),
                           "--live", "20=1.3", "--live-from", str(tmp_path / "g.json")], cwd=ROOT,
                          capture_output=True, text=True)
    assert both.returncode != 0 and "give --live or --live-from, not both" in both.stderr
