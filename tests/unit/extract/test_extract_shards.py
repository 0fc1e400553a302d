"""Shards: codec error bounds, writer -> reader round trip, one sample read without the rest, `verify` on
damaged shards, manifest checks against a drafter config."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflashkit.extract.shards.format import FP8_ABS_ERR, FP8_REL_ERR, bytes_per_token, decode_features, encode_features
from dflashkit.extract.shards.manifest import check_manifest_matches, read_manifest
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.extract.shards.verify import main as verify_main
from dflashkit.extract.shards.verify import verify_dataset
from dflashkit.extract.shards.writer import ShardWriteError, ShardWriter

K, H = 3, 16


def _manifest(codec="bf16", last=False):
    return {"schema_version": 1, "complete": False, "target": {"path": "t", "config_hash": "c" * 64,
                                                               "weights_hash": "w" * 64},
            "tokenizer_hash": "k" * 64, "target_layer_ids": [0, 2, 3], "num_target_layers": 4, "hidden_size": H,
            "vocab_size": 100, "codec": codec, "store_last_hidden": last, "skipped": {}, "shards": []}


def _samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(2, 9, (1,), generator=g))
        out.append({"index": 10 * i + 3, "ids": torch.randint(0, 100, (t,), generator=g),
                    "mask": torch.rand(t, generator=g) > 0.5,
                    "hidden": torch.randn(t, K * H, generator=g) * 10 ** torch.randn(t, 1, generator=g),
                    "last": torch.randn(t, H, generator=g)})
    return out


def _write(tmp_path, samples, codec="bf16", last=False, shard_bytes=2000, batch=3):
    w = ShardWriter(tmp_path, _manifest(codec, last), shard_bytes=shard_bytes)
    for b in range(0, len(samples), batch):
        part = samples[b: b + batch]
        w.add_batch([s["index"] for s in part], [len(s["ids"]) for s in part], torch.cat([s["ids"] for s in part]),
                    torch.cat([s["mask"] for s in part]), torch.cat([s["hidden"] for s in part]),
                    torch.cat([s["last"] for s in part]) if last else None)
    m = w.close()
    m["complete"] = True
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    return m


def test_fp8_and_bf16_round_trip_within_the_stated_bounds():
    g = torch.Generator().manual_seed(1)
    # heavy-tailed values, per-token magnitudes over 12 decades, an all-zero token and tiny values
    x = torch.randn(512, 256, generator=g) * torch.exp(2 * torch.randn(512, 256, generator=g))
    x = x * 10 ** (3 * torch.randn(512, 1, generator=g))
    x[0] = 0
    x[1, :8] = 1e-30
    amax = x.abs().amax(-1, keepdim=True)
    before = x.clone()
    values, scale = encode_features(x, "fp8")
    assert torch.equal(x, before)  # the input is left as it was (the encoding divides a copy in place)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (512,)
    err = (decode_features(values, scale).float() - x).abs()
    assert (err <= FP8_REL_ERR * x.abs() + FP8_ABS_ERR * amax).all()
    rel = (err.norm() / x.norm()).item()
    assert 0.005 < rel < 0.04  # a real fp8 rounding happened, and it is small
    values, scale = encode_features(x, "bf16")
    assert scale is None and ((decode_features(values, None).float() - x).abs() <= 2 ** -8 * x.abs()).all()
    assert bytes_per_token("bf16", 5 * 4096) == 40960 and bytes_per_token("fp8", 5 * 4096) == 20484


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_writer_reader_round_trip(tmp_path, codec):
    samples = _samples(11)
    m = _write(tmp_path, samples, codec=codec, last=True, shard_bytes=600)
    assert len(m["shards"]) >= 3 and all(s["samples"] % 3 == 0 for s in m["shards"][:-1])  # whole batches
    assert [i for s in m["shards"] for i in s["sample_indices"]] == [s["index"] for s in samples]
    ds = ShardDataset(tmp_path)
    assert len(ds) == 11 and ds.lengths == [len(s["ids"]) for s in samples]
    for k, s in enumerate(samples):
        got = ds[k]
        assert got["sample_index"] == s["index"]
        assert torch.equal(got["input_ids"], s["ids"]) and torch.equal(got["loss_mask"], s["mask"])
        assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == (len(s["ids"]), K * H)
        for key, ref in (("hidden", s["hidden"]), ("last_hidden", s["last"])):
            want = decode_features(*encode_features(ref, codec))
            assert torch.equal(got[key], want)
    assert read_manifest(tmp_path)["totals"]["samples"] == 11
    assert verify_dataset(tmp_path) == ([], [])


def test_reader_touches_only_the_requested_sample(tmp_path):
    samples = _samples(6)
    m = _write(tmp_path, samples, shard_bytes=10**9, batch=6)  # one shard
    ds = ShardDataset(tmp_path)
    from dflashkit.extract.shards.format import read_shard_header

    table, _, _ = read_shard_header(tmp_path / m["shards"][0]["file"])
    _, _, start, end = table["hidden"]
    first_bytes = len(samples[0]["ids"]) * K * H * 2
    with open(tmp_path / m["shards"][0]["file"], "r+b") as f:  # scribble over every other sample's features
        f.seek(start + first_bytes)
        f.write(b"\xff" * (end - start - first_bytes))
    fresh = ShardDataset(tmp_path)
    assert torch.equal(fresh[0]["hidden"], ds[0]["hidden"]) and torch.isfinite(fresh[0]["hidden"]).all()
    assert torch.isnan(fresh[1]["hidden"]).all()


def test_verify_names_a_truncated_and_a_flipped_shard(tmp_path, capsys):
    m = _write(tmp_path, _samples(9), codec="fp8", shard_bytes=300)
    assert verify_main([str(tmp_path)]) == 0
    first, second = (tmp_path / s["file"] for s in m["shards"][:2])
    data = first.read_bytes()
    first.write_bytes(data[: len(data) // 2])
    raw = bytearray(second.read_bytes())
    raw[len(raw) - 7] ^= 0x01
    second.write_bytes(bytes(raw))
    capsys.readouterr()
    assert verify_main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{first}: size" in err and "truncated" in err
    assert f"{second}: sha256 differs" in err
    third = tmp_path / m["shards"][2]["file"]
    assert str(third) not in err


def test_verify_catches_nan_shape_and_duplicate_even_with_matching_hashes(tmp_path):
    import hashlib

    import safetensors.torch

    m = _write(tmp_path, _samples(6), batch=6, shard_bytes=10**9)
    path = tmp_path / m["shards"][0]["file"]
    tensors = safetensors.torch.load_file(path)
    tensors["hidden"][2, 5] = float("nan")
    data = safetensors.torch.save(tensors)
    path.write_bytes(data)
    m["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    m["shards"].append(dict(m["shards"][0]))  # the same shard listed twice: every sample twice
    m["totals"]["shards"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    errors, _ = verify_dataset(tmp_path)
    assert any("NaN/Inf" in e and f"sample {m['shards'][0]['sample_indices'][0]}" in e for e in errors)
    assert any("also in" in e for e in errors)


def test_writer_refuses_nan_features_naming_the_sample(tmp_path):
    s = _samples(2)
    s[1]["hidden"][0, 0] = float("inf")
    w = ShardWriter(tmp_path, _manifest())
    w.add_batch([7, 8], [len(x["ids"]) for x in s], torch.cat([x["ids"] for x in s]),
                torch.cat([x["mask"] for x in s]), torch.cat([x["hidden"] for x in s]), where=["a:1", "a:2"])
    with pytest.raises(ShardWriteError, match=r"sample 8 \(a:2\)"):
        w.close()
    assert not list(tmp_path.glob("shard-*"))


def test_manifest_check_names_the_field_that_disagrees(tmp_path):
    from dflashkit.drafter import DrafterConfig

    m = _manifest()
    ok = DrafterConfig(hidden_size=H, num_target_layers=4, vocab_size=100, target_layer_ids=[0, 2, 3],
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32)
    check_manifest_matches(m, ok, {"config_hash": "c" * 64, "weights_hash": "w" * 64})
    for field, value in (("target_layer_ids", [0, 1, 3]), ("hidden_size", 32), ("vocab_size", 101)):
        bad = dict(ok.__dict__, **{field: value})
        with pytest.raises(ValueError, match=f"^{field}:"):
            check_manifest_matches(m, bad)
    with pytest.raises(ValueError, match="^target.weights_hash:"):
        check_manifest_matches(m, ok, {"config_hash": "c" * 64, "weights_hash": "x" * 64})
    with pytest.raises(ValueError, match="^tokenizer_hash:"):
        check_manifest_matches(m, ok, {"tokenizer_hash": "z" * 64})
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="--resume"):
        ShardDataset(tmp_path)  # complete=false


def test_shard_file_is_what_safetensors_writes_and_its_hash_is_the_files(tmp_path):
    import hashlib
    import struct

    import safetensors.torch

    from dflashkit.extract.shards.format import safetensors_parts
    from dflashkit.files import atomic_write

    g = torch.Generator().manual_seed(3)
    blocks = {"hidden": [torch.randn(n, 6, generator=g).to(torch.float8_e4m3fn) for n in (3, 0, 5)],
              "hidden_scale": [torch.rand(n, generator=g) for n in (3, 0, 5)],
              "input_ids": [torch.arange(8, dtype=torch.int32)], "loss_mask": [torch.rand(8, generator=g) > 0.5],
              "offsets": [torch.tensor([0, 3, 8])], "last_hidden": [torch.randn(8, 2, generator=g).bfloat16()]}
    meta = {"format": "dflashkit-shard", "codec": "fp8"}
    sha = atomic_write(tmp_path / "a.safetensors", safetensors_parts(blocks, meta))
    data = (tmp_path / "a.safetensors").read_bytes()
    assert sha == hashlib.sha256(data).hexdigest() and not list(tmp_path.glob(".*tmp"))
    joined = {k: torch.cat(v) for k, v in blocks.items()}
    loaded = safetensors.torch.load(data)
    assert loaded.keys() == joined.keys()
    for k, v in joined.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
    reference = safetensors.torch.save(joined, metadata=meta)

    def header(raw):
        (n,) = struct.unpack("<Q", raw[:8])
        return n, json.loads(raw[8: 8 + n])

    (n, mine), (n_ref, theirs) = header(data), header(reference)
    assert (n, mine) == (n_ref, theirs)  # the same layout (the key order inside the JSON aside)
    assert data[8 + n:] == reference[8 + n_ref:]


def _in_thread(fn, *args):
    """Run fn in a thread and return its result; a hang fails the test instead of stalling the run."""
    import threading

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "hung"
    return result["value"]


def test_staging_pool_reuses_buffers_and_a_full_pool_waits_for_one_to_come_back():
    from dflashkit.extract.shards.staging import StagingPool

    pool = StagingPool(limit=2048)
    a = pool.take(1000, pin=False)
    assert a.numel() == 1024  # capacity: the next power of two
    pool.give([a])
    b = pool.take(600, pin=False)
    assert b is a  # reused, not allocated again
    c = pool.take(1024, pin=False)  # the pool is full now: 2048 bytes in use
    with ThreadPoolExecutor(1) as other:
        waiter = other.submit(pool.take, 900, False)
        pool.give([c])
        assert waiter.result(timeout=120) is c  # it could only have the buffer given back: a new one exceeds the limit
    # the buffers of a shard still being collected do not count: more batches must be able to complete it
    pool.set_collecting(2048)
    d = _in_thread(pool.take, 1024, False)
    assert d.numel() == 1024 and d is not a and d is not c


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_staging_smaller_than_a_shard_gives_the_same_shards(tmp_path, codec):
    samples = _samples(13, seed=4)
    m_big = _write(tmp_path / "big", samples, codec=codec, last=True, shard_bytes=3000)
    small = ShardWriter(tmp_path / "small", _manifest(codec, True), shard_bytes=3000, staging_bytes=256)

    def write_all():
        for b in range(0, len(samples), 3):
            part = samples[b: b + 3]
            small.add_batch([s["index"] for s in part], [len(s["ids"]) for s in part],
                            torch.cat([s["ids"] for s in part]), torch.cat([s["mask"] for s in part]),
                            torch.cat([s["hidden"] for s in part]), torch.cat([s["last"] for s in part]))
        return small.close()

    m_small = _in_thread(write_all)
    assert [s["sha256"] for s in m_small["shards"]] == [s["sha256"] for s in m_big["shards"]]
    assert len(m_small["shards"]) >= 2


def _write_counted(path, samples, writer_threads, staging_bytes, codec="fp8"):
    """Batches of 2 samples with a new skip/note count snapshot on every third batch; many small shards."""
    w = ShardWriter(path, _manifest(codec, True), shard_bytes=900, staging_bytes=staging_bytes,
                    writer_threads=writer_threads)
    handed = []  # (samples handed over so far, newest counts) after each batch
    counts = None
    for b in range(0, len(samples), 2):
        part = samples[b: b + 2]
        if b % 3 == 0:
            counts = {"skipped": {"malformed_json": b}, "notes": {"truncated": b // 2}}
        w.add_batch([s["index"] for s in part], [len(s["ids"]) for s in part], torch.cat([s["ids"] for s in part]),
                    torch.cat([s["mask"] for s in part]), torch.cat([s["hidden"] for s in part]),
                    torch.cat([s["last"] for s in part]), counts=counts if b % 3 == 0 else None)
        handed.append((b + len(part), counts))
    return w.close(), handed


def test_several_shards_in_flight_write_the_same_bytes_and_manifests_as_one(tmp_path, monkeypatch):
    import dflashkit.extract.shards.writer as writer_module

    samples = _samples(41, seed=5)
    written = {}  # run -> every manifest as written, in order
    real = writer_module.write_manifest

    def recording(run):
        def write_manifest(path, manifest, *shard_lines):
            written.setdefault(run, []).append(json.dumps(manifest, sort_keys=True))
            real(path, manifest, *shard_lines)
            assert json.loads(path.read_text()) == manifest  # the lines are its shards
        return write_manifest

    # one writer thread; three (shards written ahead as unnamed files, where the system has them); three with
    # a staging pool of one batch; three writing each shard in its turn (systems without unnamed files)
    runs = {"one": (1, 1 << 30, True), "three": (3, 1 << 30, True), "three_small_staging": (3, 4096, True),
            "three_in_turn": (3, 1 << 30, False)}
    for run, (threads, staging, unnamed) in runs.items():
        monkeypatch.setattr(writer_module, "write_manifest", recording(run))
        if not unnamed:
            monkeypatch.setattr(writer_module, "unnamed_files_work", lambda probe: False)
        m, handed = _in_thread(_write_counted, tmp_path / run, samples, threads, staging)
        assert len(m["shards"]) >= 8
    files = {run: sorted(p.name for p in (tmp_path / run).iterdir()) for run in runs}
    assert all(names == files["one"] for names in files.values())
    for name in files["one"]:
        assert len({(tmp_path / run / name).read_bytes() for run in runs}) == 1
    assert all(manifests == written["one"] for manifests in written.values())
    # each manifest lists the shards in order and carries the counts of the newest batch in its last shard
    for k, text in enumerate(written["three"]):
        m = json.loads(text)
        assert [s["seq"] for s in m["shards"]] == list(range(k + 1))
        n = sum(s["samples"] for s in m["shards"])
        newest = next(c for done, c in handed if done == n)
        assert (m["skipped"], m.get("notes")) == (newest["skipped"], newest["notes"])
    errors, _ = verify_dataset(tmp_path / "three")  # sizes, sha256s, layout of every listed shard
    assert errors == []


def test_shards_complete_before_a_nan_batch_are_written_and_listed(tmp_path):
    samples = _samples(15, seed=6)
    samples[10]["hidden"][1, 2] = float("nan")  # in the 4th batch of 3; one batch per shard

    def write_all():
        w = ShardWriter(tmp_path, _manifest(), shard_bytes=1, writer_threads=3)
        with pytest.raises(ShardWriteError, match=f"sample {samples[10]['index']}"):
            for b in range(0, len(samples), 3):  # raised here once the writer has seen the bad batch, or at close
                part = samples[b: b + 3]
                w.add_batch([s["index"] for s in part], [len(s["ids"]) for s in part],
                            torch.cat([s["ids"] for s in part]), torch.cat([s["mask"] for s in part]),
                            torch.cat([s["hidden"] for s in part]))
            w.close()
        w.abort()
        return json.loads((tmp_path / "manifest.json").read_text())

    m = _in_thread(write_all)
    assert [s["sample_indices"] for s in m["shards"]] == [[s["index"] for s in samples[b: b + 3]] for b in (0, 3, 6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([s["file"] for s in m["shards"]] + ["manifest.json"])
    m["complete"] = True
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert verify_dataset(tmp_path) == ([], [])


def test_a_file_written_unnamed_has_no_name_until_published(tmp_path):
    import os

    from dflashkit.files import publish, unnamed_files_work, write_unnamed

    if not unnamed_files_work(tmp_path / ".probe.tmp"):
        pytest.skip("no O_TMPFILE here: shards are written in turn by atomic_write (tested above)")
    assert list(tmp_path.iterdir()) == []  # the probe left nothing
    parts = [b"header--", torch.arange(1000, dtype=torch.int32).numpy(), b"", bytearray(b"tail")]
    fd = write_unnamed(tmp_path, parts)
    try:
        assert list(tmp_path.iterdir()) == []  # written and fsynced, in no directory
        publish(fd, tmp_path / "a.bin")
    finally:
        os.close(fd)
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
    assert (tmp_path / "a.bin").read_bytes() == b"header--" + parts[1].tobytes() + b"tail"
    fd = write_unnamed(tmp_path, [b"dropped"])
    os.close(fd)  # closed before publish (a killed run): nothing remains
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_buffers_are_written_in_few_large_calls_and_whole_when_a_call_writes_less(tmp_path, monkeypatch):
    import os
    import random

    import dflashkit.files as files

    rng = random.Random(0)
    parts = [os.urandom(n) for n in (5, 0, 300, 1, 64, 1000, 7)]
    monkeypatch.setattr(files, "_CHUNK_BYTES", 100)
    views = [memoryview(b) for b in parts if b]
    chunks = list(files._chunks(views))
    assert [sum(v.nbytes for v in c) for c in chunks] == [100] * 13 + [77]  # gathered across buffers and split
    assert b"".join(bytes(v) for c in chunks for v in c) == b"".join(parts)
    real, calls = os.writev, []

    def short_writev(fd, buffers):  # the system may write less than asked: here at most 1..40 bytes a call
        calls.append(len(buffers))
        return real(fd, [memoryview(b"".join(bytes(b) for b in buffers))[: rng.randint(1, 40)]])

    monkeypatch.setattr(os, "writev", short_writev)
    with open(tmp_path / "f", "wb") as f:
        files._write_buffers(f.fileno(), [memoryview(b) for b in parts])
    assert (tmp_path / "f").read_bytes() == b"".join(parts) and len(calls) > len(chunks)
