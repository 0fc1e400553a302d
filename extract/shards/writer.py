"""The shard writer: batches in, crash-safe shards and manifest out, with the disk working behind the forward.

Design choices:
- Crash safety: a shard is written to a temporary name, fsynced, renamed, the directory fsynced; only then is it
  added to the manifest, which is itself rewritten the same way after every shard. A run killed at any point
  leaves the manifest listing only complete shards; leftovers (temporary files, renamed shards the manifest does
  not list) are removed on resume and their samples redone. Shards hold whole batches, so a resumed run re-plans
  the same batches and skips the ones done: the result equals an uninterrupted run.
- The path of the bytes: ``add_batch`` encodes the features on the device and starts their copy into a reused
  host staging buffer (pinned memory, on a side CUDA stream, so the next forward runs during the copy) and
  returns. A collector thread waits for the copy, checks the features are finite and groups batches into shards;
  once a shard's worth is there, it lays out the file (``format.safetensors_parts``: the header, then views of
  the staging buffers; no joining copy), starts its sha256 on a thread pool and queues it. ``WRITER_THREADS``
  writer threads each take the next shard and write it from the same buffers while it is hashed. So several
  shards are in flight: written and hashed at once (sha256 runs at ~1.2 GB/s per thread, slower than a fast
  disk; one thread cannot keep the disk busy while it waits for fsyncs), more collecting in staging buffers. A
  shard's buffers are reused once its bytes are on disk; the forward waits only when ``staging_bytes`` are all
  full, i.e. when the disk is the bound.
- Shards are written ahead as unnamed files (``dflashkit.files.write_unnamed``: Linux O_TMPFILE, fsynced, in no
  directory) and then named and listed one at a time, in sequence order (``files.publish``: temporary name,
  rename, directory fsync; then the manifest). The directory goes through exactly the states of writing one
  shard after another: at most one temporary file, at most one renamed shard the manifest does not list yet,
  the listed shards a prefix of the sequence; a crash leaves nothing of the unnamed files. Where unnamed files
  are missing (other systems, some file systems), each shard is written by ``atomic_write`` in its turn, and
  only the hashing runs ahead.
- The interpreter lock: a GPU-bound forward's thread holds it nearly always (its kernel launches block with it
  held once the GPU's queue is full), so a thread here that gives it up (any system call, hash update or torch
  op) gets it back only at the switch interval, ~5 ms. Hence few, large system calls per shard
  (``dflashkit/files.py``), and nothing long that holds the lock: rewriting the manifest encodes only the new
  shard's line and the fields (the lines of the shards listed before are kept), not every entry again.
- Errors on the threads (disk full, NaN/Inf features) are raised in the caller at its next call. Shards complete
  before a NaN/Inf batch are still written; after a failed write, in sequence order, nothing more is.
- Several ranks: each writes its own shards (rank in the file name) and its own ``manifest.rank{r}.json``;
  rank 0 merges them into ``manifest.json`` at the end. One process writes ``manifest.json`` directly.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflashkit.errors import UserError
from dflashkit.files import atomic_write, pause_point, publish, sha256_of, unnamed_files_work, write_unnamed

from .format import decode_features, encode_features, safetensors_parts
from .manifest import (
    MANIFEST,
    SCHEMA_VERSION,
    TOTALLED,
    rank_manifest_name,
    read_manifest,
    shard_line,
    shard_name,
    totals,
    update_totals,
    write_manifest,
)
from .staging import StagingPool

_ALIGN = 64  # bytes; tensors inside a staging buffer start at multiples of this
WRITER_THREADS = 3  # shards written and hashed at once: ~3 GB/s of sha256; more would only hold more staging


class ShardWriteError(RuntimeError):
    """Writing a shard failed (disk full, file-size limit, I/O error) or the features were not finite."""


class ShardWriter:
    """Collects batches of samples and writes them as shards on background threads.

    ``manifest`` is the run's manifest (target identity, layer ids, codec, ...); the writer adds ``shards`` and
    ``totals`` and rewrites it after every shard. Call ``add_batch`` per batch, then ``close``.
    ``staging_bytes``: host memory for features waiting for the disk (pinned when they come from a GPU).
    ``writer_threads``: shards written and hashed at once (the files and the manifest do not depend on it).
    ``writes_ahead``: whether this directory has unnamed files, so shards are written ahead of their turn.
    """

    def __init__(self, out_dir, manifest: dict, rank: int = 0, world_size: int = 1,
                 shard_bytes: int = 512 << 20, staging_bytes: int = 4 << 30, writer_threads: int = WRITER_THREADS):
        if writer_threads < 1:
            raise UserError(f"writer_threads={writer_threads}: must be at least 1")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.shard_bytes = rank, world_size, shard_bytes
        self.manifest = manifest
        self.manifest.setdefault("shards", [])
        self.codec = manifest["codec"]
        self.manifest_path = self.dir / rank_manifest_name(rank, world_size)
        listed = self.manifest["shards"]
        self._shard_lines = [shard_line(s) for s in listed]  # the manifest's lines of the listed shards
        self._sums = {"shards": len(listed), **{k: sum(s[k] for s in listed) for k in TOTALLED}}
        mine = [s for s in listed if s["rank"] == rank]
        self.seq = 1 + max((s["seq"] for s in mine), default=-1)  # of the next shard to collect
        self.pending: list[dict] = []  # batches of the shard being collected
        self.pending_bytes = 0
        self._counts = None  # the newest skip/note counts handed over
        self.pool = StagingPool(staging_bytes)
        self._streams: dict = {}  # device -> side stream for the copies to the host
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._batches: queue.Queue = queue.Queue()  # caller -> collector
        self._shards: queue.Queue = queue.Queue()  # collector -> writer threads, in seq order
        self.writes_ahead = unnamed_files_work(self.dir / f".shard-r{rank:03d}-probe.tmp")
        self._turn = self.seq  # the next shard to name and list
        self._turn_cv = threading.Condition()
        self._write_failed = False
        self._hash_pool = ThreadPoolExecutor(writer_threads, thread_name_prefix="dflashkit-shard-sha256")
        self._threads = [threading.Thread(target=self._collect, name="dflashkit-shard-collector", daemon=True)]
        self._threads += [threading.Thread(target=self._write_shards, name=f"dflashkit-shard-writer-{i}", daemon=True)
                          for i in range(writer_threads)]
        for t in self._threads:
            t.start()

    # -- caller side
    def add_batch(self, sample_index: list[int], lengths: list[int], input_ids, loss_mask, hidden: torch.Tensor,
                  last_hidden: torch.Tensor | None = None, where: list[str] | None = None,
                  counts: dict | None = None) -> None:
        """One batch, packed: token tensors [sum(lengths)] and features [sum(lengths), D] on any device.

        Returns once the copy to the host has started; waits first when the staging buffers are full.
        ``where`` (file:line per sample) names a sample in errors; ``counts`` ({"skipped": {...}, "notes": {...}},
        a snapshot) goes into the manifest with the shard that completes with or after this batch.
        """
        self._raise_if_failed()
        device = {}
        device["hidden"], device["hidden_scale"] = encode_features(hidden, self.codec)
        if last_hidden is not None:
            device["last_hidden"], device["last_hidden_scale"] = encode_features(last_hidden, self.codec)
        device = {k: v for k, v in device.items() if v is not None}
        # fp8: a token's scale is max|x| / 448, finite exactly when the token's values are
        checked = [device.get(f"{k}_scale", device[k]) for k in ("hidden", "last_hidden") if k in device]
        if hidden.is_cuda:
            flags = [torch.isfinite(t).all() for t in checked]
        else:  # min and max are finite exactly when all values are (NaN propagates): ~14x cheaper on the host
            flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in checked if t.numel()]
        device["finite"] = (torch.stack(flags).all() if flags else torch.tensor(True)).reshape(1)
        sizes = {k: -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN for k, v in device.items()}
        cuda = hidden.is_cuda
        buf = self.pool.take(sum(sizes.values()), pin=cuda)
        staged, at = {}, 0
        for k, v in device.items():
            staged[k] = buf[at: at + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            at += sizes[k]
        event = None
        if cuda:
            stream = self._streams.get(hidden.device)
            if stream is None:
                stream = self._streams[hidden.device] = torch.cuda.Stream(hidden.device)
            stream.wait_stream(torch.cuda.current_stream(hidden.device))
            with torch.cuda.stream(stream):
                for k, v in device.items():
                    staged[k].copy_(v, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            for v in device.values():  # their memory is not reused before the copies are done
                v.record_stream(stream)
        else:
            for k, v in device.items():
                staged[k].copy_(v)
        self._batches.put({"sample_index": list(sample_index), "lengths": list(lengths), "where": where,
                           "counts": counts, "input_ids": torch.as_tensor(input_ids, dtype=torch.int32).cpu(),
                           "loss_mask": torch.as_tensor(loss_mask, dtype=torch.bool).cpu(), "staged": staged,
                           "buffer": buf, "event": event})

    def close(self) -> dict:
        """Write what is pending as a last shard, stop the threads, return the manifest."""
        self._stop()
        self._raise_if_failed()
        return self.manifest

    def abort(self) -> None:
        """After an error elsewhere: keep the complete batches handed over (as a shard), stop the threads, raise
        nothing (the caller's error is the one to report)."""
        self._stop()

    def _stop(self):
        if self._threads[0].is_alive():
            self._batches.put(None)
        for t in self._threads:
            t.join()
        self._hash_pool.shutdown()

    def _raise_if_failed(self):
        if self._error is not None:
            raise self._error

    def _fail(self, e: BaseException):
        with self._error_lock:
            if self._error is None:  # the first error is the one to report
                self._error = e

    # -- collector thread: batches -> complete shards (in order), their sha256 started
    def _collect(self):
        try:
            while True:
                item = self._batches.get()
                if item is None:
                    break
                if self._error is not None:  # drain: free the buffers a blocked add_batch waits for
                    self.pool.give([item["buffer"]])
                    continue
                try:
                    self._take(item)
                except BaseException as e:  # surfaced in the caller
                    self._fail(e)
                    self._release(self.pending)
                    self.pending, self.pending_bytes = [], 0
            if self.pending and self._error is None:
                try:
                    self._hand_over_shard()
                except BaseException as e:
                    self._fail(e)
            self._release(self.pending)
        finally:
            self._shards.put(None)

    def _release(self, items):
        self.pool.give([it["buffer"] for it in items])
        self.pool.set_collecting(0)

    def _take(self, item):
        if item["event"] is not None:
            item["event"].synchronize()
        staged = item["staged"]
        if not bool(staged.pop("finite")):
            values = [decode_features(staged[k], staged.get(f"{k}_scale")).float()
                      for k in ("hidden", "last_hidden") if k in staged]
            bad = torch.stack([(~torch.isfinite(v)).any(-1) for v in values]).any(0)
            bad_tok = int(bad.nonzero()[0, 0])
            self.pool.give([item["buffer"]])
            k = bisect.bisect_right(np.cumsum(item["lengths"]).tolist(), bad_tok)
            where = f" ({item['where'][k]})" if item.get("where") else ""
            raise ShardWriteError(f"the target produced NaN/Inf features for sample {item['sample_index'][k]}{where}; "
                                  "nothing of that batch was written. Load the target in bfloat16 or float32 "
                                  "(float16 overflows in many models) and run again with --resume")
        if item.get("counts"):
            self._counts = item.pop("counts")
        self.pending.append(item)
        self.pending_bytes += sum(t.numel() * t.element_size() for t in
                                  (*staged.values(), item["input_ids"], item["loss_mask"]))
        if self.pending_bytes >= self.shard_bytes:
            self._hand_over_shard()
        else:
            self.pool.set_collecting(sum(it["buffer"].numel() for it in self.pending))

    def _hand_over_shard(self):
        """The pending batches as one shard: its file's buffers laid out, its sha256 started on the hash pool,
        queued for the shard writer. Their staging buffers come back once the shard is on disk."""
        items, self.pending, self.pending_bytes = self.pending, [], 0
        self.pool.set_collecting(0)
        lengths = [n for it in items for n in it["lengths"]]
        sample_index = torch.tensor([i for it in items for i in it["sample_index"]], dtype=torch.int64)
        blocks = {"sample_index": [sample_index],
                  "offsets": [torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int64)],
                  "input_ids": [it["input_ids"] for it in items], "loss_mask": [it["loss_mask"] for it in items]}
        for key in items[0]["staged"]:
            blocks[key] = [it["staged"][key] for it in items]
        try:
            parts = safetensors_parts(blocks, {"format": "dflashkit-shard", "codec": self.codec,
                                               "schema_version": str(SCHEMA_VERSION)})
            sha256 = self._hash_pool.submit(sha256_of, parts)
        except BaseException:
            self._release(items)
            raise
        entry = {"file": shard_name(self.rank, self.seq), "rank": self.rank, "seq": self.seq,
                 "samples": len(lengths), "tokens": int(sum(lengths)),
                 "loss_tokens": int(sum(int(it["loss_mask"].sum()) for it in items)),
                 "bytes": sum(memoryview(p).nbytes for p in parts), "sha256": None,
                 "sample_indices": sample_index.tolist()}
        self._shards.put({"entry": entry, "parts": parts, "sha256": sha256, "items": items, "counts": self._counts})
        self.seq += 1

    # -- writer threads: shards written at once, named and listed one at a time in sequence order
    def _write_shards(self):
        while True:
            shard = self._shards.get()
            if shard is None:
                self._shards.put(None)  # for the other writer threads
                return
            fd, error = None, None
            try:
                if self.writes_ahead and not self._write_failed:
                    try:  # ahead of its turn: the bytes to the disk, in a file without a name yet
                        fd = write_unnamed(self.dir, shard["parts"])
                        shard["entry"]["sha256"] = shard["sha256"].result()
                    except OSError as e:  # reported in its turn, after the shards before it
                        error = self._write_error(shard["entry"], e)
                    except BaseException as e:
                        error = e
                    self._give_back(shard)
                with self._in_turn(shard["entry"]["seq"]):
                    try:
                        if error is not None:
                            raise error
                        if not self._write_failed:  # after a failed write nothing more is written
                            self._write_shard(shard, fd)
                    except BaseException as e:  # surfaced in the caller
                        self._write_failed = True
                        self._fail(e)
            finally:
                if fd is not None:
                    os.close(fd)  # an unnamed file never named is gone with it
                self._give_back(shard)

    @contextlib.contextmanager
    def _in_turn(self, seq: int):
        with self._turn_cv:
            while self._turn != seq:
                self._turn_cv.wait()
        try:
            yield
        finally:
            with self._turn_cv:
                self._turn += 1
                self._turn_cv.notify_all()

    def _give_back(self, shard):
        """The shard's staging buffers back to the pool, once the hash thread is done with them."""
        if shard.pop("parts", None) is not None:
            shard["sha256"].cancel() or shard["sha256"].exception()
            self.pool.give([it["buffer"] for it in shard["items"]])

    def _write_error(self, entry, e: OSError) -> ShardWriteError:
        err = ShardWriteError(
            f"could not write shard {self.dir / entry['file']} ({entry['bytes']} bytes): {e.strerror or e} "
            f"[errno {e.errno}]. The manifest lists only complete shards; free disk space (or raise the "
            f"file-size limit) and run the same command with --resume")
        err.__cause__ = e
        return err

    def _write_shard(self, shard, fd: int | None):
        """In its turn: name the shard written ahead (``fd``), or write it now; then list it."""
        entry = shard["entry"]
        seq, path = entry["seq"], self.dir / entry["file"]
        try:
            if fd is not None:
                publish(fd, path, pause_name=f"shard-{seq}-written")
            else:
                entry["sha256"] = atomic_write(path, shard["parts"], pause_name=f"shard-{seq}-written",
                                               sha256=shard["sha256"])
                self._give_back(shard)
        except OSError as e:
            raise self._write_error(entry, e) from e
        pause_point(f"shard-{seq}-renamed")
        if shard["counts"]:
            self.manifest.update(shard["counts"])
        self.manifest["shards"].append(entry)
        self._shard_lines.append(shard_line(entry))
        self._sums["shards"] += 1
        for k in TOTALLED:
            self._sums[k] += entry[k]
        self.manifest["totals"] = totals(self._sums)
        write_manifest(self.manifest_path, self.manifest, self._shard_lines)
        pause_point(f"shard-{seq}-listed")


def prepare_resume(out_dir, rank: int, world_size: int) -> dict | None:
    """This rank's manifest so far (None: nothing done) after removing leftovers of a killed run."""
    out_dir = Path(out_dir)
    part = out_dir / rank_manifest_name(rank, world_size)
    manifest = None
    if part.exists():
        manifest = read_manifest(part)  # checked: a damaged manifest is one line naming the file and field
    elif (out_dir / MANIFEST).exists():
        manifest = read_manifest(out_dir / MANIFEST)
        manifest["shards"] = [s for s in manifest["shards"] if s.get("rank", 0) == rank]
    listed = {s["file"] for s in manifest["shards"]} if manifest else set()
    for p in out_dir.glob(f"shard-r{rank:03d}-*.safetensors"):
        if p.name not in listed:  # renamed by a run killed before it updated the manifest: redo its samples
            p.unlink()
    for p in out_dir.glob(f".shard-r{rank:03d}-*.tmp"):
        p.unlink()
    return manifest


def merge_manifests(out_dir, world_size: int, final: dict) -> dict:
    """Rank 0, after a barrier: one manifest.json from every rank's part (their shards and skip counts)."""
    out_dir = Path(out_dir)
    merged = dict(final)
    merged["shards"], skipped, notes = [], {}, {}
    for r in range(world_size):
        part = json.loads((out_dir / rank_manifest_name(r, world_size)).read_text())
        merged["shards"] += part["shards"]
        for key, acc in (("skipped", skipped), ("notes", notes)):
            for reason, n in part.get(key, {}).items():
                acc[reason] = acc.get(reason, 0) + n
        merged["complete"] = merged.get("complete", True) and part.get("complete", False)
    merged["shards"].sort(key=lambda s: (s["rank"], s["seq"]))
    merged["skipped"], merged["notes"] = skipped, notes
    update_totals(merged)
    write_manifest(out_dir / MANIFEST, merged)
    if world_size > 1:
        for r in range(world_size):
            (out_dir / rank_manifest_name(r, world_size)).unlink(missing_ok=True)
    return merged
