"""bench/bench_train_throughput.py with two drafter architectures in one process: their offline steps timed in
turn on the same micro-batches, each profiled with its own drafter (the toy shape on the CPU: that the pairing
holds together, not a measurement)."""

import json
import re

import pytest

from bench import bench_train_throughput as btt


def test_two_architectures_are_timed_in_turn_on_the_same_steps(tmp_path, monkeypatch):
    out, prof = tmp_path / "pair.json", tmp_path / "prof.txt"
    order, step = [], btt.Step.__call__

    def recorded(self, micros):  # which architecture's step ran, in call order
        order.append(self.cfg.drafter_architecture)
        return step(self, micros)

    monkeypatch.setattr(btt.Step, "__call__", recorded)
    btt.main(["--toy", "--device", "cpu", "--drafter-architecture", "dflash,dflash2", "--modes", "offline",
              "--steps", "4", "--warmup", "1", "--out", str(out), "--profile", str(prof)])
    # one warm-up step each, then the 4 timed steps in turn, the order alternating; then 3 profiled steps each
    a, b = "dflash", "dflash2"
    assert order == [a, b] + [a, b, b, a, a, b, b, a] + [a] * 3 + [b] * 3
    r = json.loads(out.read_text())
    assert r["architectures"] == ["dflash", "dflash2"] and "single" not in r
    a, b, pair = r["paired"][a], r["paired"][b], r["paired"]["dflash2_vs_dflash"]
    assert a["steps"] == b["steps"] == 4 and a["step_tokens"] == b["step_tokens"]  # the same micro-batches
    # the ratios are the two runs' own figures: same tokens, so throughput = time of DFlash over DFlash2's
    assert pair["throughput_ratio"] == pytest.approx(b["ctx_tokens_per_s"] / a["ctx_tokens_per_s"])
    assert pair["throughput_ratio_of_medians"] == pytest.approx(a["step_ms_median"] / b["step_ms_median"])
    assert pair["step_ratios"] == pytest.approx([x / y for x, y in zip(a["step_ms"], b["step_ms"])], rel=1e-3)
    # each architecture's step ran its own drafter: only DFlash2's takes the selector's candidates (a top-k)
    profiles = {k: (tmp_path / f"prof_{k}.txt").read_text() for k in ("dflash", "dflash2")}
    assert "aten::topk" in profiles["dflash2"] and "aten::topk" not in profiles["dflash"]
    # and each profile's operators again apart by their inputs' shapes. Which operators make the table's 30 rows
    # (sorted by their time) and where its shape column is cut vary from run to run, so this asks for the column
    # and for rows that list tensor shapes, not for a given operator's
    for text in profiles.values():
        by_shape = text.split("by input shapes:")[1]
        assert "Input Shapes" in by_shape
        assert any(re.search(r"\[\[\d+,", line) for line in by_shape.splitlines()), by_shape
    # and every operator (on a GPU every kernel) with no row limit: DFlash2's convolutions' roll among them
    every = {k: t.split("every operator (total ms, calls, ms a call, name):\n")[1] for k, t in profiles.items()}
    assert "aten::roll" in every["dflash2"] and "aten::roll" not in every["dflash"]
    assert all(len(t.splitlines()) > 40 for t in every.values())  # more than the top table's rows


@pytest.mark.parametrize("argv", [["--drafter-architecture", "dflash,dflash2", "--modes", "offline,online"],
                                  ["--drafter-architecture", "dflash,eagle"],
                                  ["--drafter-architecture", "dflash,dflash"]])
def test_architecture_lists_it_cannot_time_in_turn_are_refused(tmp_path, argv):
    with pytest.raises(SystemExit):
        btt.main(["--toy", "--device", "cpu", "--out", str(tmp_path / "x.json"), *argv])
    assert not (tmp_path / "x.json").exists()


def test_the_selector_flags_reach_the_dflash2_pass(tmp_path, monkeypatch, capsys):
    """--selector-kernel, --conv-kernel and --selector-unary-grad: the steps' drafter pass gets selector_kernel
    (on the CPU its kernels give way to torch, train/selector_pair.py) and selector_unary_grad, the convolutions'
    switch is asked and answers for the CPU (train/dynamic_conv.py), and the JSON records all three."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen, step = [], btt.Step.__call__

    def recorded(self, micros):
        options = self.options.term_options
        seen.append((self.cfg.drafter_architecture, options.kernel, options.unary_grad))
        return step(self, micros)

    monkeypatch.setattr(btt.Step, "__call__", recorded)
    out = tmp_path / "k.json"
    btt.main(["--toy", "--device", "cpu", "--drafter-architecture", "dflash2", "--modes", "offline",
              "--steps", "2", "--warmup", "1", "--selector-kernel", "--selector-unary-grad", "--conv-kernel",
              "--out", str(out)])
    assert seen and set(seen) == {("dflash2", True, True)}
    assert "conv_kernel: Triton does not run on cpu" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["train_config"]["selector_kernel"] is True and r["train_config"]["selector_unary_grad"] is True
    assert r["train_config"]["conv_kernel"] is True


@pytest.mark.parametrize("stack_bytes,stacked,ns_dtype", [(None, True, None), (0, False, None),
                                                            (None, True, "bfloat16"), (None, True, "auto")])
def test_the_muon_step_is_timed_with_its_stacks(tmp_path, stack_bytes, stacked, ns_dtype):
    """--optimizer muon times the recipe's optimizer; --muon-stack-bytes 0 the step with one matrix per stack;
    --muon-ns-dtype bfloat16 with bf16 Newton-Schulz (auto: the recipe's, fp32 on this CPU); the JSON says how
    the drafter's matrices were stacked and in which dtype they were orthogonalised."""
    from dflashkit.train import muon

    out = tmp_path / "m.json"
    before = muon.STACK_BYTES
    extra = [] if stack_bytes is None else ["--muon-stack-bytes", str(stack_bytes)]
    extra += [] if ns_dtype is None else ["--muon-ns-dtype", ns_dtype]
    try:
        btt.main(["--toy", "--device", "cpu", "--modes", "offline", "--steps", "2", "--warmup", "1",
                  "--optimizer", "muon", *extra, "--out", str(out)])
    finally:
        muon.STACK_BYTES = before
    r = json.loads(out.read_text())
    assert r["train_config"]["optimizer"] == "muon" and r["single"]["offline"]["steps"] == 2
    assert r["train_config"]["muon_ns_dtype"] == (ns_dtype or "float32")
    layout = r["muon"]
    assert layout["matrices"] > 5 and (layout["stacks"] < layout["matrices"]) == stacked
    assert layout["stack_bytes"] == (before if stack_bytes is None else 0)
    assert layout["ns_dtype"] == ("float32" if ns_dtype in (None, "auto") else ns_dtype)


@pytest.mark.parametrize("flag", [["--muon-stack-bytes", "0"], ["--muon-ns-dtype", "bfloat16"]])
def test_muon_flags_need_muon(tmp_path, flag):
    with pytest.raises(SystemExit):
        btt.main(["--toy", "--device", "cpu", *flag, "--out", str(tmp_path / "x.json")])
