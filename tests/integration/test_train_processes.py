"""Training in fresh processes, stopped or launched as a user would: a run SIGKILLed right after a checkpoint resumes
(past a half-written and a damaged checkpoint) to the losses of an uninterrupted run; Muon under `accelerate
launch` (DDP, 2 processes, gloo) gives the single-process weights; a diverging DDP run stops both ranks at the
same step with one error line (the in-process cases: tests/unit/train/test_train_trainer.py,
test_train_recipe_options.py, test_train_reliability.py)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from dflashkit.train.checkpoint import list_checkpoints, verify_checkpoint
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.paths import ROOT
from support.processes import ACCELERATE_LAUNCH, run_checked, run_until_paused
from support.training import as_argv, tiny_overrides, train_losses


@pytest.mark.slow
def test_sigkill_and_resume_match_an_uninterrupted_run(tiny_run, tmp_path, capsys):
    target, shards = tiny_run
    straight = tmp_path / "straight"
    summary = train(load_config(None, [], **tiny_overrides(shards, straight, epochs=4)))
    assert summary["step"] == 20 and summary["epochs_completed"] == 4

    killed = tmp_path / "killed"
    argv = as_argv(tiny_overrides(shards, killed, epochs=4))
    # the test-only pause hook holds the run right after its step-10 checkpoint; killed there, deterministically
    proc = run_until_paused([sys.executable, "-m", "dflashkit.train", *argv], "checkpoint-10-saved",
                            tmp_path / "paused")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists()
    real = [p for p in list_checkpoints(killed) if verify_checkpoint(p) is None]
    assert real, "no complete checkpoint before the kill"
    last = int(real[-1].name.split("-")[1])

    # what a death in the middle of a checkpoint write leaves, and a checkpoint damaged afterwards
    half = killed / "checkpoints" / f"step-{last + 4:08d}"
    half.mkdir()
    (half / "model.safetensors").write_bytes((real[-1] / "model.safetensors").read_bytes()[:100])
    damaged = killed / "checkpoints" / f"step-{last + 2:08d}"
    shutil.copytree(real[-1], damaged)
    blob = bytearray((damaged / "model.safetensors").read_bytes())
    blob[-7] ^= 0x40
    (damaged / "model.safetensors").write_bytes(bytes(blob))
    shutil.copytree(real[-1], killed / "checkpoints" / f".tmp-step-{last + 6:08d}")

    capsys.readouterr()
    resumed = train(load_config(None, [], **tiny_overrides(shards, killed, epochs=4)))
    log = capsys.readouterr().out
    assert f"skipping checkpoint {half}: no checkpoint.json" in log
    assert f"skipping checkpoint {damaged}: model.safetensors does not match its sha256" in log
    assert f"resumed from {real[-1]} (step {last}," in log

    a, b = train_losses(straight), train_losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    for key in ("eval/loss", "eval/tau_sim", "eval/acc"):
        assert resumed[key] == pytest.approx(summary[key], rel=1e-6)


@pytest.mark.slow
def test_muon_under_ddp_gives_the_single_process_run(tiny_run, tmp_path, one_thread):
    """The single-process run in this process, on one thread as each launched process is."""
    from dflashkit.train.__main__ import main

    _, shards = tiny_run
    fields = dict(optimizer="muon", max_steps=3, epochs=1, save_every=0)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert main(as_argv(tiny_overrides(shards, single, grad_accum=4, **fields))) == 0
    run_checked([*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes" / "accelerate" / "ddp.yaml"),
                 "--num_processes", "2", "-m", "dflashkit.train",
                 *as_argv(tiny_overrides(shards, ddp, grad_accum=2, **fields))])
    a = load_file(str(single / "checkpoints" / "step-00000003" / "model.safetensors"))
    b = load_file(str(ddp / "checkpoints" / "step-00000003" / "model.safetensors"))
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k


@pytest.mark.slow
def test_two_processes_stop_together_when_the_run_diverges(tiny_run, tmp_path):
    """Under `accelerate launch` (DDP, gloo): the ranks learn of a NaN in one collective and stop at the same step;
    both exit 1, nothing hangs, rank 0 alone prints the line."""
    _, shards = tiny_run
    out = tmp_path / "ddp"
    cmd = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes" / "accelerate" / "ddp.yaml"),
           "--num_processes", "2", "-m", "dflashkit.train",
           *as_argv(tiny_overrides(shards, out, grad_accum=1, lr=1e30, warmup_ratio=0, save_every=1))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "dflashkit train: error: training diverged" in line]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    assert all(int(p.name.split("-")[1]) < step for p in list_checkpoints(out))
    assert not (out / "export").exists() and not (out / "summary.json").exists()


@pytest.mark.slow
def test_a_second_process_takes_its_compiled_layers_from_the_cache(tiny_run, tmp_path, monkeypatch):
    """compile=true: summary.json says how many graphs were compiled and how many came from the compile cache.
    A fresh cache compiles every graph; a second process on the same cache (another run directory, as a warm-up
    beside the answering and the run after it) compiles none: what lab/testbed_quality_run.sh's WARM=1 counts on."""
    import json

    target, shards = tiny_run
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))  # not the user's own cache
    summaries = []
    for name in ("warm", "run"):
        out = tmp_path / name
        run_checked([sys.executable, "-m", "dflashkit.train",
                     *as_argv(tiny_overrides(shards, out, epochs=1, compile=True, save_every=0))])
        summaries.append(json.loads((out / "summary.json").read_text())["compiled_graphs"])
    warm, run = summaries
    assert warm["compiled"] >= 1 and warm["from_cache"] == 0
    assert run == {"from_cache": warm["compiled"], "compiled": 0}
