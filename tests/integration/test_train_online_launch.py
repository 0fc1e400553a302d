"""Online training launched as several processes (gloo, CPU) gives the single-process run: 2 processes under
`accelerate launch` with each config the recipes ship (DDP, ZeRO-2, FSDP), and two "machines" on localhost
(recipes/accelerate/multinode.yaml, one process each); the same losses at every step and the same final weights
as one process with twice the gradient accumulation (one process against extraction: tests/unit/train/
test_train_online.py)."""

import os

import pytest

from support.paths import ROOT
from support.processes import ACCELERATE_LAUNCH, run_checked
from support.training import as_argv, extract_chat_run
from support.training import online_overrides as overrides
from support.training import train_losses as losses


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """(tiny target with the testbed tokenizer, chat jsonl, shards extracted from it): tests/unit/train/conftest.py's
    chat run."""
    return extract_chat_run(tmp_path_factory.mktemp("online"))


def launch_argv(target_dir, data, out, **kw) -> list[str]:
    d = overrides(out, target=target_dir, data=[data], eval_every=0, save_every=0, max_steps=3, **kw)
    return as_argv(d)


def final_weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / "step-00000003" / "model.safetensors"))


@pytest.fixture(scope="module")
def single_online(chat_run, tmp_path_factory, one_thread):
    """The reference: one process, grad_accum 4 = 2 processes x grad_accum 2 (this test process, on one thread as
    each launched process is: the launches are what the tests are about, not this run)."""
    from dflashkit.train.__main__ import main

    target_dir, data, _ = chat_run
    out = tmp_path_factory.mktemp("single-online") / "run"
    assert main(launch_argv(target_dir, data, out, grad_accum=4)) == 0
    return losses(out), out


def assert_same_run(out, single_online):
    ref_losses, ref_out = single_online
    got = losses(out)
    assert sorted(got) == sorted(ref_losses) == [1, 2, 3]
    for step, loss in got.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-5), step
    a, b = final_weights(out), final_weights(ref_out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "zero2", "fsdp"])
def test_online_under_accelerate_launch_gives_the_single_process_run(config, chat_run, single_online, tmp_path):
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the ZeRO run cannot be launched")
    target_dir, data, _ = chat_run
    out = tmp_path / config
    log = run_checked([*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"),
                   "--num_processes", "2", "-m", "dflashkit.train", *launch_argv(target_dir, data, out, grad_accum=2)])
    expected = {"ddp": "MULTI_CPU", "zero2": "DEEPSPEED", "fsdp": "MULTI_CPU"}[config]
    assert f"dflashkit train ({expected}, cpu): online, 12 training" in log and "2 process(es) x 2" in log
    assert_same_run(out, single_online)


@pytest.mark.slow
def test_two_machines_on_localhost_give_the_single_process_run(chat_run, single_online, tmp_path):
    """recipes/accelerate/multinode.yaml launched twice, as machine 0 and machine 1 (one process each)."""
    import socket
    import subprocess

    target_dir, data, _ = chat_run
    out = tmp_path / "two-machines"
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for machine in (0, 1):
        cmd = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes" / "accelerate" / "multinode.yaml"),
               "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "-m", "dflashkit.train", *launch_argv(target_dir, data, out, grad_accum=2)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "dflashkit train (MULTI_CPU, cpu): online, 12 training" in logs[0] and "2 process(es) x 2" in logs[0]
    assert_same_run(out, single_online)
