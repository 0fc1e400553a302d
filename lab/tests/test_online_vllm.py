"""lab/bench_online_vllm.py at toy size on the CPU (the capture twin, a tiny random target with the testbed's
tokenizer, synthetic chats, a 2-step drafter): both paths train, export and are evaluated live, and since the twin
computes Hugging Face's features the two paths log the same loss at every step."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_toy_run_trains_and_evaluates_both_paths(tmp_path):
    out = tmp_path / "online_vllm.json"
    proc = subprocess.run([sys.executable, "-m", "lab.bench_online_vllm", "--standin", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    paths = results["paths"]
    assert sorted(paths) == ["hf", "vllm"]
    for name, row in paths.items():
        assert row["status"] == "done" and row["target_engine"] == name, row.get("traceback")
        assert row["step"] == 2 and row["tau"] >= 1 and row["prompts"] == 2 and not row["eval_partial"]
        assert row["train_wall_s"] > 0 and row["eval_wall_s"] > 0 and row["train_tokens_per_s_median"] > 0
        assert sorted(row["train_losses"], key=int) == ["1", "2"]
        assert row["final_train_loss"] == row["train_losses"]["2"]
        assert isinstance(row["eval/loss"], float) and row["eval/tau_sim"] >= 1
        assert row["target_layer_ids"] == [1, 3]  # the toy target has 6 layers: 5, the last, would be refused
        assert row["max_memory_allocated"] is None and row["gpu_used_peak_mib"] is None  # the CPU
        assert (Path(row["export_dir"]) / "model.safetensors").is_file()
    assert paths["vllm"]["target_gpu_memory_utilization"] == 0.3
    assert paths["hf"]["train_losses"] == paths["vllm"]["train_losses"]

    c = results["comparison"]
    assert c["per_step_losses_equal"] is True and c["max_abs_loss_diff"] == 0 and c["logged_steps"] == 2
    assert c["tau_vllm_minus_hf"] == paths["vllm"]["tau"] - paths["hf"]["tau"]
    assert c["goal_abs_tau_diff"] == 0.03 and isinstance(c["within_goal"], bool) and c["same_setup"] is True
    assert "tau(vllm) - tau(hf)" in proc.stdout and "wrote" in proc.stdout

    # a second command with one path keeps the other path's results and compares again
    again = subprocess.run([sys.executable, "-m", "lab.bench_online_vllm", "--standin", "--paths", "vllm", "--out",
                            str(out), "--work-dir", str(tmp_path / "work2")], cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    merged = json.loads(out.read_text())
    assert merged["paths"]["hf"] == paths["hf"] and merged["paths"]["vllm"]["date"]
    assert merged["comparison"]["per_step_losses_equal"] is True
