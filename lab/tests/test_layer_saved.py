"""lab/bench_layer_saved.py on the CPU at a toy size (eager layers: the measurement's plumbing, not its numbers):
one layer of each architecture at the testbed's width, every tensor kept for the backward counted once."""

import json
import os
import subprocess
import sys

import pytest

from lab import bench_layer_saved as bls

from support.paths import ROOT


def test_each_architecture_is_measured_and_dflash2_keeps_more(tmp_path):
    out = tmp_path / "saved.json"
    result = bls.main(["--eager", "--blocks", "4", "--context", "32", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    dflash, dflash2 = result["layers"]
    assert (dflash["architecture"], dflash2["architecture"], result["compiled"]) == ("dflash", "dflash2", False)
    # its convolutions (four a layer) and their kernel projections keep tensors of their own
    assert dflash2["kept_tensors"] > dflash["kept_tensors"] > 0
    assert dflash2["block_activations"] > dflash["block_activations"] > 1
    assert result["dflash2_extra_block_activations"] == dflash2["block_activations"] - dflash["block_activations"]
    assert dflash["kept_mib"] * 2**20 == pytest.approx(dflash["block_activations"] * 4 * 16 * 576 * 2)


def test_the_conv_kernels_row_where_triton_runs_and_a_refusal_where_not(tmp_path, monkeypatch):
    """--conv-kernel: under the Triton interpreter (a fresh process) a third row, DFlash2 with its convolutions
    by the kernels, which keeps less than the torch convolutions and more than DFlash; on a CPU without the
    interpreter a refusal that names what it needs, and no file."""
    pytest.importorskip("triton", reason="triton is not installed")
    out = tmp_path / "conv.json"
    run = subprocess.run([sys.executable, "-m", "lab.bench_layer_saved", "--eager", "--blocks", "4", "--context", "32",
                          "--conv-kernel", "--out", str(out)], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    dflash, dflash2, kernel = json.loads(out.read_text())["layers"]
    assert kernel["architecture"] == "dflash2+conv_kernel"
    assert dflash["block_activations"] < kernel["block_activations"] < dflash2["block_activations"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="Triton does not run on cpu"):
        bls.main(["--eager", "--blocks", "4", "--context", "32", "--conv-kernel", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
