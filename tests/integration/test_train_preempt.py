"""Preemption: SIGTERM or SIGINT while training writes a checkpoint at the current step and exits 0 saying how to
resume; `dflashkit export` takes that checkpoint; resuming finishes with the losses of an uninterrupted run.
The signal is sent while the process sits at the test-only pause point after step 3, so where it lands is exact."""

import os
import signal
import sys

import pytest

from dflashkit.train.checkpoint import list_checkpoints, read_trainer_state, verify_checkpoint
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.paths import ROOT
from support.processes import ACCELERATE_LAUNCH, run_until_paused
from support.training import as_argv, tiny_overrides, train_losses


def overrides(shards, out, **kw) -> dict:
    return tiny_overrides(shards, out, **{"epochs": 1, "keep_last": 5, **kw})


@pytest.fixture(scope="module")
def uninterrupted(tiny_run, tmp_path_factory):
    """(summary, run directory) of the run the stopped ones must match, trained once for both signals."""
    _, shards = tiny_run
    straight = tmp_path_factory.mktemp("straight") / "run"
    return train(load_config(None, [], **overrides(shards, straight))), straight


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_checkpoints_the_current_step_then_resume_matches(tiny_run, uninterrupted, tmp_path, sig):
    _, shards = tiny_run
    summary, straight = uninterrupted
    assert summary["step"] == 5

    out = tmp_path / "stopped"
    argv = as_argv(overrides(shards, out))
    proc = run_until_paused([sys.executable, "-m", "dflashkit.train", *argv], "step-3-done", tmp_path / "paused")
    os.kill(proc.pid, getattr(signal, sig))
    assert proc.wait(timeout=300) == 0
    message = proc.stderr.read().decode()
    ckpt = out / "checkpoints" / "step-00000003"
    assert f"stopped by {sig} at step 3 of 5; checkpoint {ckpt} written" in message
    assert "Resume with the same command" in message
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002", "step-00000003"]
    assert verify_checkpoint(ckpt) is None and read_trainer_state(ckpt)["step"] == 3
    assert not (out / "summary.json").exists() and not (out / "export").exists()  # the run is not finished

    from dflashkit.cli import main as cli
    from dflashkit.drafter import load_drafter

    assert cli(["export", str(ckpt), str(tmp_path / "exported")]) == 0
    assert load_drafter(tmp_path / "exported").block_size == 4

    resumed = train(load_config(None, [], **overrides(shards, out)))  # resume=auto
    assert resumed["step"] == 5 and not resumed.get("preempted")
    a, b = train_losses(straight), train_losses(out)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    assert resumed["eval/loss"] == pytest.approx(summary["eval/loss"], rel=1e-6)


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step(tiny_run, tmp_path):
    """Under `accelerate launch` (DDP, gloo), SIGTERM to both training processes: they agree on the step, write one
    checkpoint together and exit 0, and so does the launcher."""
    import psutil

    _, shards = tiny_run
    out = tmp_path / "ddp"
    config = ROOT / "recipes" / "accelerate" / "ddp.yaml"
    cmd = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_processes", "2",
           "-m", "dflashkit.train", *as_argv(overrides(shards, out, grad_accum=1))]
    proc = run_until_paused(cmd, "step-3-done", tmp_path / "paused")
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "dflashkit.train" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    for p in ranks:
        p.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0
    assert "stopped by SIGTERM at step 3 of 5" in proc.stderr.read().decode()
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002", "step-00000003"]
    assert verify_checkpoint(out / "checkpoints" / "step-00000003") is None
