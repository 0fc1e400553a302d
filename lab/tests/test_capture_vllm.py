"""lab/bench_capture_vllm.py at toy size on the CPU (the capture twin, tiny random targets, synthetic chats): every
part writes its JSON (the float32 reference too), the twin's shards equal Hugging Face extraction's (the same HF
math: errors ~0), features/s are positive, and a part that fails leaves the others' results in the file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import bench_capture_vllm

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_toy_run_writes_every_part(tmp_path):
    out = tmp_path / "capture.json"
    proc = subprocess.run([sys.executable, "-m", "lab.bench_capture_vllm", "--standin", "--samples", "8",
                           "--out", str(out), "--work-dir", str(tmp_path / "work")], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    eq = results["equality"]
    assert eq["samples"] == 8 and eq["ids_equal"] and eq["verify_vllm"]["errors"] == [] and eq["passes"]
    assert len(eq["per_tap"]) >= 2 and [t["layer_id"] for t in eq["per_tap"]] == eq["layer_ids"]
    for tap in eq["per_tap"]:  # float32 on both sides, each prompt alone vs padded batches: rounding only
        assert tap["max_rel"] < 1e-4 and tap["mean_rel"] < 1e-5 and tap["tokens"] > 0
        assert set(tap) >= {"mean_token_rel", "max_element_rel", "max_abs"}
    assert set(eq["formulas"]) >= {"max_rel", "mean_rel"}

    for shape in ("target", "qwen3-8b"):
        row = results["throughput"][shape]
        assert all(row[k]["features_per_s"] > 0 for k in ("vllm", "hf", "hf_to_host")), row
        assert row["vllm_over_hf"] > 0 and len(row["vllm"]["seconds"]) == 2
        mem = results["memory"][shape]
        assert mem["hf"]["weights_bytes"] > 0 and mem["hf"]["cpu_max_rss_mib"] > 0
        assert mem["vllm"]["cpu_max_rss_mib"] > 0 and mem["hf"]["pid"] != mem["vllm"]["pid"]
    ref = results["reference"]  # on the CPU "bf16" is the float32 default: the same HF extraction twice
    assert [t["layer_id"] for t in ref["hf_vs_fp32"]["per_tap"]] == eq["layer_ids"]
    assert all(t["max_rel"] == 0 for t in ref["hf_vs_fp32"]["per_tap"])
    assert all(t["max_rel"] < 1e-4 for t in ref["vllm_vs_fp32"]["per_tap"] + ref["hf_vs_vllm"]["per_tap"])
    assert len(ref["vllm_within_hf_bf16"]) == len(eq["layer_ids"]) and isinstance(ref["passes"], bool)
    assert results["throughput"]["qwen3-8b"]["layer_ids"] == [1, 2, 3, 4, 5]  # QWEN3_TOY: 8 layers, 5 taps
    assert "wrote" in proc.stdout and "equality layer" in proc.stdout


def test_a_failed_part_leaves_the_others(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("equality broke")

    monkeypatch.setattr(bench_capture_vllm, "part_equality", broken)
    out = tmp_path / "capture.json"
    rc = bench_capture_vllm.main(["--standin", "--samples", "4", "--parts", "equality", "throughput", "--shapes",
                                  "target", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    results = json.loads(out.read_text())
    assert rc == 1 and "equality broke" in results["equality"]["error"]
    assert "Traceback" in results["equality"]["traceback"]
    assert results["throughput"]["target"]["vllm"]["features_per_s"] > 0
