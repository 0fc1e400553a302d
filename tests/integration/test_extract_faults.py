"""Extraction under faults: SIGKILL at random points then --resume, a disk that fills during a shard write, and
two ranks (gloo) writing one dataset. Each ends with exactly the samples of an uninterrupted run."""

import json
import os
import resource
import signal
import socket
import subprocess
import sys

import pytest
import torch

from dflashkit.extract.__main__ import main
from dflashkit.extract.shards.manifest import read_manifest
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.extract.shards.verify import verify_dataset

from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.processes import run_until_paused

FLAGS = ["--layer-ids", "0,2,3", "--batch-tokens", "300", "--bucket-window", "8", "--shard-size", "1",
         "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


def _cmd(target, data, out, *extra):
    return [sys.executable, "-m", "dflashkit.extract", "--target", target, "--data", data, "--out", str(out),
            *FLAGS, *extra]


def _shards_listed(out):
    try:
        return len(json.loads((out / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _by_index(out):
    ds = ShardDataset(out)
    return {ds[k]["sample_index"]: ds[k] for k in range(len(ds))}


def assert_same_dataset(out, ref, exact=True):
    got, want = _by_index(out), _by_index(ref)
    assert sorted(got) == sorted(want)  # every sample exactly once (ShardDataset would list a repeat twice)
    assert len(ShardDataset(out)) == len(want)
    for i, w in want.items():
        g = got[i]
        assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["loss_mask"], w["loss_mask"])
        if exact:
            assert torch.equal(g["hidden"], w["hidden"])
        else:
            torch.testing.assert_close(g["hidden"].float(), w["hidden"].float(), rtol=2 ** -7, atol=1e-5)
    a, b = read_manifest(out), read_manifest(ref)
    assert a["skipped"] == b["skipped"] and a["totals"]["tokens"] == b["totals"]["tokens"]
    assert verify_dataset(out)[0] == []


@pytest.mark.slow
def test_sigkill_at_ten_points_then_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(96, seed=1), [(5, "{broken")])
    ref = tmp_path / "ref"
    assert main(["--target", tiny, "--data", data, "--out", str(ref), *FLAGS]) == 0
    total = len(read_manifest(ref)["shards"])
    assert total >= 12, total
    # ten kills at ten distinct points, spread over the run: shard `seq` written to its temporary name but not
    # renamed, renamed but not listed in the manifest, or listed; each run resumes the one before.
    stages = ["written", "renamed", "listed"]
    points = [(round(1 + k * (total - 3) / 9), stages[k % 3]) for k in range(10)]
    assert len(set(points)) == 10
    out, pause_file = tmp_path / "out", tmp_path / "paused"
    for seq, stage in points:
        proc = run_until_paused(_cmd(tiny, data, out, "--resume"), f"shard-{seq}-{stage}", pause_file)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert verify_dataset(out)[0] == []  # what a killed run leaves is always consistent
        listed = _shards_listed(out)
        assert listed == (seq + 1 if stage == "listed" else seq), (seq, stage, listed)
        if stage != "written":  # the renamed shard is on disk; only a listed one survives the resume
            assert (out / read_manifest(ref)["shards"][seq]["file"]).exists()
        assert (stage == "written") == any(out.glob(".*tmp"))
    # the last resume in this process (as the reference ran): it reads what the killed processes left
    assert main(["--target", tiny, "--data", data, "--out", str(out), *FLAGS, "--resume"]) == 0
    assert_same_dataset(out, ref)
    assert not list(out.glob(".*tmp"))


def test_disk_full_during_a_shard_write_then_resume(tiny, tmp_path):
    short = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 11
    long = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "echo " * 400}]}
    data = write_jsonl(tmp_path / "d.jsonl", short[:9] + [long] + short[9:])  # index 9: in the 2nd window of 8
    ref = tmp_path / "ref"
    assert main(["--target", tiny, "--data", data, "--out", str(ref), *FLAGS]) == 0
    sizes = [s["bytes"] for s in read_manifest(ref)["shards"]]
    limit = (max(sizes) + sorted(sizes)[-2]) // 2  # every shard fits but the one holding the long sample

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    proc = subprocess.run(_cmd(tiny, data, out), capture_output=True, text=True, preexec_fn=small_disk)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]  # the environment's
    assert "could not write shard" in proc.stderr and "File too large" in proc.stderr and "--resume" in proc.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert 0 < len(m["shards"]) < len(sizes) and not m["complete"]
    assert all(s["bytes"] < limit for s in m["shards"])  # no partial shard listed
    assert not list(out.glob(".*tmp")) and verify_dataset(out)[0] == []
    assert main(["--target", tiny, "--data", data, "--out", str(out), *FLAGS, "--resume"]) == 0
    assert_same_dataset(out, ref)
    shards = read_manifest(out)["shards"]
    assert main(["--target", tiny, "--data", data, "--out", str(out), *FLAGS, "--resume"]) == 0  # nothing left
    assert read_manifest(out)["shards"] == shards


@pytest.mark.slow
def test_two_ranks_write_disjoint_shards_and_one_manifest(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(13, seed=2), [(4, "{broken")])
    ref = tmp_path / "ref"
    assert main(["--target", tiny, "--data", data, "--out", str(ref), *FLAGS]) == 0
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen(_cmd(tiny, data, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    m = read_manifest(out)
    assert m["world_size"] == 2 and m["complete"] and {s["rank"] for s in m["shards"]} == {0, 1}
    for s in m["shards"]:  # rank r holds the samples i with i % 2 == r, in files named after it
        assert all(i % 2 == s["rank"] for i in s["sample_indices"]) and s["file"].startswith(f"shard-r{s['rank']:03d}")
    assert not list(out.glob("manifest.rank*.json"))
    assert_same_dataset(out, ref, exact=False)  # other batch mates, other padding: equal up to rounding
