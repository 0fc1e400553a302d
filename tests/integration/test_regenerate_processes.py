"""`dflashkit regenerate` in fresh processes: two ranks (torchrun, gloo on the CPU) split the prompts and merge into
the single-rank output, also after a resume; SIGTERM keeps the conversations answered so far and a resume
completes them in input order (the in-process cases: tests/unit/extract/test_extract_regenerate.py and
test_extract_generator.py)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from dflashkit.cli import run_main
from dflashkit.extract.regenerate import main as regenerate_main

from support.chat_data import REGENERATE_RECORDS, save_tiny_chat_target, write_jsonl
from support.processes import run_until_paused


def main(argv):
    """The command as `dflashkit regenerate` runs it: a user error is one line on stderr and exit status 2."""
    return run_main("dflashkit regenerate", regenerate_main, argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # large random weights: answers vary from token to token instead of repeating one
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target", initializer_range=0.5)


@pytest.mark.slow
def test_ranks_split_the_prompts_and_merge(tmp_path, one_thread):
    """Two ranks (torchrun, gloo on the CPU) write the same file as one process (this one, on one thread as each
    rank is), including after a resume."""
    target = save_tiny_chat_target(tmp_path / "target", initializer_range=0.5)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in REGENERATE_RECORDS * 2))
    flags = ["--target", str(target), "--data", str(data), "--max-new-tokens", "5", "--batch-size", "2",
             "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = tmp_path / "one.jsonl"
    assert main([*flags, "--out", str(one)]) == 0
    two = tmp_path / "two.jsonl"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "dflashkit.extract.regenerate", *flags, "--out", str(two)]
    r = subprocess.run([*launch, "--limit", "5"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(x)["index"] for x in two.read_text().splitlines()] == [0, 1, 2, 4]
    r = subprocess.run([*launch, "--resume"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert two.read_text() == one.read_text()
    assert not list(tmp_path.glob("two.jsonl.rank*"))  # parts merged and removed


def test_sigterm_keeps_the_answered_conversations_and_resume_completes_in_order(tiny, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS)
    whole = tmp_path / "whole.jsonl"
    assert main(["--target", tiny, "--data", data, "--out", str(whole), "--max-new-tokens", "6", "--batch-size",
                 "2", "--no-progress"]) == 0
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflashkit.extract.regenerate", "--target", tiny, "--data", data, "--out", str(out),
           "--max-new-tokens", "6", "--batch-size", "2", "--no-progress", "--device", "cpu"]
    proc = run_until_paused(cmd, "regenerate-1-done", tmp_path / "paused")  # record 1 has just been answered
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert "--resume" in proc.stderr.read().decode()
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 in [r["index"] for r in kept] and len(kept) < 4  # written at the stop, the rest still to do
    want = {json.loads(line)["index"]: line for line in whole.read_text().splitlines()}
    assert all(json.dumps(r) == json.dumps(json.loads(want[r["index"]])) for r in kept)
    assert main([*cmd[3:], "--resume"]) == 0
    assert out.read_text() == whole.read_text()  # every conversation once, in input order
