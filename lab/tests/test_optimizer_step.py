"""lab/bench_optimizer_step.py: the optimizer step alone, AdamW and the Muon forms on the same gradients."""

import json

from dflashkit.train import muon
from lab import bench_optimizer_step as bos


def test_the_optimizer_step_bench_times_each_form_on_the_same_gradients(tmp_path):
    """At the toy shape on the CPU: the four forms, each step timed, the Muon forms' stacks counted (the check that
    it runs, not a measurement)."""
    before = muon.STACK_BYTES
    r = bos.main(["--toy", "--device", "cpu", "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "o.json")])
    assert muon.STACK_BYTES == before  # muon_one's cap is put back
    assert json.loads((tmp_path / "o.json").read_text()) == r
    assert set(r["forms"]) == {"adamw", "muon_one", "muon", "muon_bf16"}
    assert all(len(f["step_ms"]) == 3 and f["step_ms_median"] > 0 for f in r["forms"].values())
    assert 1 < r["muon_stacks"] < r["muon_matrices"]
