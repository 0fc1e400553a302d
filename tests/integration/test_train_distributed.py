"""A few steps under `accelerate launch` with 2 processes (gloo, CPU) give the single-process loss: DDP,
DeepSpeed ZeRO-2 and ZeRO-3, each launched with the accelerate config file the recipes ship; the FSDP config,
which accelerate runs as plain data parallelism without GPUs, says so and gives the same loss."""

import pytest

from dflashkit.train.tracking import read_metrics

from support.paths import ROOT
from support.processes import ACCELERATE_LAUNCH, run_checked
from support.training import as_argv


def common(shards, out, **kw):
    d = dict(shards=str(shards), output_dir=str(out), mask_token_id=95, num_hidden_layers=2, block_size=4,
             num_anchors=8, eval_samples=3, eval_anchors=4, epochs=1, mixed_precision="no", wandb=False,
             save_every=0, log_every=1, eval_every=0, num_workers=0, progress=False, max_steps=3,
             drafter={"intermediate_size": 64}, micro_batch_tokens=0)  # one sequence per micro-batch
    # 3 held-out samples on 2 processes: one rank's last evaluation pass pads (every rank the same passes: ZeRO-3)
    d.update(kw)
    return as_argv(d)


def metrics(out):
    rows = read_metrics(out)
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}, rows[-1]


@pytest.fixture(scope="module")
def single(tiny_run, tmp_path_factory, one_thread):
    """The reference: one process, grad_accum 4 = 2 processes x grad_accum 2 (this test process, on one thread as
    each launched process is: the launches are what the tests are about, not this run)."""
    from dflashkit.train.__main__ import main

    _, shards = tiny_run
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(common(shards, out, grad_accum=4)) == 0
    return (*metrics(out), out)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "zero2", "fsdp", "zero3"])
def test_two_processes_give_the_single_process_loss(config, single, tiny_run, tmp_path):
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the ZeRO run cannot be launched")
    _, shards = tiny_run
    out = tmp_path / config
    log = run_checked([*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"),
               "--num_processes", "2", "-m", "dflashkit.train", *common(shards, out, grad_accum=2)])
    expected = {"ddp": "MULTI_CPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "MULTI_CPU"}[config]
    assert f"dflashkit train ({expected}, cpu)" in log and "2 process(es) x 2 micro-batches" in log
    assert ("asks for FSDP, but accelerate runs it as MULTI_CPU" in log) == (config == "fsdp")
    losses, final = metrics(out)
    ref_losses, ref_final, ref_out = single
    assert sorted(losses) == sorted(ref_losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-5), step
    assert final["eval/loss"] == pytest.approx(ref_final["eval/loss"], rel=1e-5)
    # the checkpoint of the sharded run holds the same full weights as the single-process one
    from safetensors.torch import load_file

    a = load_file(str(out / "checkpoints" / "step-00000003" / "model.safetensors"))
    b = load_file(str(ref_out / "checkpoints" / "step-00000003" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k
