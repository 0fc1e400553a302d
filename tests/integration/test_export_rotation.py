"""An export in a fresh process whose checkpoint is rotated away by the training between being resolved and
being opened (held at the pause point ``export-checkpoint-resolved``): from a run directory it resolves the
run's newest checkpoint again and names that one; from a step directory it stops in one line. Never an export
of one step named as another (issue 71; the in-process cases: tests/unit/dflashkit/test_outputs_apart.py)."""

import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from support.processes import run_until_paused
from support.shards import make_shards
from support.tiny_targets import make_tiny_target
from support.training import later_checkpoint, tiny_overrides


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from accelerate.state import AcceleratorState, GradientState

    from dflashkit.train.config import TrainConfig
    from dflashkit.train.trainer import train

    root = tmp_path_factory.mktemp("rotation")
    target = make_tiny_target(root / "target")
    shards = make_shards(root / "shards", target, num_samples=6)
    train(TrainConfig(**tiny_overrides(shards, root / "run", max_steps=1, eval_samples=1)))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return root / "run"


def export_rotated_meanwhile(source, out, run, pause_file):
    """``dflashkit export source out`` held once ``source`` is resolved, the run's step 6 written and step 1
    rotated away meanwhile, then let go; (exit status, stderr)."""
    proc = run_until_paused([sys.executable, "-m", "dflashkit.train.export", str(source), str(out), "--dtype",
                             "float32"], "export-checkpoint-resolved", pause_file)
    later_checkpoint(run, 6)
    pause_file.unlink()  # the export goes on
    status = proc.wait(timeout=300)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return status, err


def test_a_run_directory_rotated_meanwhile_exports_the_newest_and_names_it(run, tmp_path):
    run = shutil.copytree(run, tmp_path / "run")
    out = tmp_path / "drafter"
    status, err = export_rotated_meanwhile(run, out, run, tmp_path / "paused")
    assert status == 0, err
    step6 = run / "checkpoints" / "step-00000006"
    weights = load_file(step6 / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["dflashkit_step"] == "6" and f.metadata()["dflashkit_checkpoint"] == str(step6)
        assert all(torch.equal(f.get_tensor(k), weights[k]) for k in f.keys())


def test_a_step_directory_rotated_meanwhile_stops_in_one_line(run, tmp_path):
    run = shutil.copytree(run, tmp_path / "run")
    step1 = run / "checkpoints" / "step-00000001"
    out = tmp_path / "drafter"
    status, err = export_rotated_meanwhile(step1, out, run, tmp_path / "paused")
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"checkpoint {step1} was removed while it was being read" in lines[0], err
    assert not out.exists()
