"""The shard writer: batches in, crash-safe shards and manifest out, on a background thread.

Design choices:
- Crash safety: a shard is written to a temporary name, fsynced, renamed, the directory fsynced; only then is it
  added to the manifest, which is itself rewritten the same way after every shard. A run killed at any point
  leaves the manifest listing only complete shards; leftovers (temporary files, renamed shards the manifest does
  not list) are removed on resume and their samples redone. Shards hold whole batches, so a resumed run re-plans
  the same batches and skips the ones done: the result equals an uninterrupted run.
- The writer runs on a background thread behind a bounded queue: the caller hands over device tensors, the copy
  to host is started non-blocking and waited for on the thread, so the accelerator does not wait for the disk.
  Errors on the thread (disk full, NaN/Inf features) are raised in the caller at its next call.
- Several ranks: each writes its own shards (rank in the file name) and its own ``manifest.rank{r}.json``;
  rank 0 merges them into ``manifest.json`` at the end. One process writes ``manifest.json`` directly.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from .shards import (MANIFEST, SCHEMA_VERSION, atomic_write, decode_features, encode_features, pause_point,
                     rank_manifest_name, shard_name, update_totals, write_manifest)


class ShardWriteError(RuntimeError):
    """Writing a shard failed (disk full, file-size limit, I/O error) or the features were not finite."""


class ShardWriter:
    """Collects batches of samples and writes them as shards on a background thread.

    ``manifest`` is the run's manifest (target identity, layer ids, codec, ...); the writer adds ``shards`` and
    ``totals`` and rewrites it after every shard. Call ``add_batch`` per batch, then ``close``.
    """

    def __init__(self, out_dir, manifest: dict, rank: int = 0, world_size: int = 1,
                 shard_bytes: int = 512 << 20, queue_batches: int = 4):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.shard_bytes = rank, world_size, shard_bytes
        self.manifest = manifest
        self.manifest.setdefault("shards", [])
        self.codec = manifest["codec"]
        self.manifest_path = self.dir / rank_manifest_name(rank, world_size)
        mine = [s for s in self.manifest["shards"] if s["rank"] == rank]
        self.seq = 1 + max((s["seq"] for s in mine), default=-1)
        self.pending: list[dict] = []
        self.pending_bytes = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._thread = threading.Thread(target=self._run, name="dflashkit-shard-writer", daemon=True)
        self._thread.start()

    # -- caller side
    def add_batch(self, sample_index: list[int], lengths: list[int], input_ids, loss_mask, hidden: torch.Tensor,
                  last_hidden: torch.Tensor | None = None, where: list[str] | None = None,
                  counts: dict | None = None) -> None:
        """One batch, packed: token tensors [sum(lengths)] and features [sum(lengths), D] on any device.

        ``where`` (file:line per sample) names a sample in errors; ``counts`` ({"skipped": {...}, "notes": {...}},
        a snapshot) goes into the manifest with the next shard.
        """
        self._raise_if_failed()
        hidden, scale = encode_features(hidden, self.codec)
        item = {"sample_index": list(sample_index), "lengths": list(lengths), "where": where, "counts": counts,
                "input_ids": torch.as_tensor(input_ids, dtype=torch.int32).cpu(),
                "loss_mask": torch.as_tensor(loss_mask, dtype=torch.bool).cpu(),
                "finite": torch.isfinite(scale if scale is not None else hidden).all().to("cpu", non_blocking=True),
                "hidden": hidden.to("cpu", non_blocking=True),
                "hidden_scale": scale.to("cpu", non_blocking=True) if scale is not None else None}
        if last_hidden is not None:
            lh, lh_scale = encode_features(last_hidden, self.codec)
            item["last_hidden"] = lh.to("cpu", non_blocking=True)
            item["last_hidden_scale"] = lh_scale.to("cpu", non_blocking=True) if lh_scale is not None else None
        item["event"] = torch.cuda.Event() if hidden.is_cuda else None
        if item["event"] is not None:
            item["event"].record()
        item["_keep"] = (hidden, scale)  # device tensors stay alive until the copy is done
        self._queue.put(item)

    def close(self) -> dict:
        """Write what is pending as a last shard, stop the thread, return the manifest."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.manifest

    def abort(self) -> None:
        """After an error elsewhere: keep the complete batches handed over (as a shard), stop the thread, raise
        nothing (the caller's error is the one to report)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _raise_if_failed(self):
        if self._error is not None:
            raise self._error

    # -- thread side
    def _run(self):
        while True:
            item = self._queue.get()
            try:
                if self._error is not None:
                    continue
                if item is None:
                    if self.pending:
                        self._write_shard()
                    return
                self._take(item)
            except BaseException as e:  # surfaced in the caller
                self._error = e
            finally:
                if item is None:
                    return

    def _take(self, item):
        if item["event"] is not None:
            item["event"].synchronize()
        item.pop("_keep"), item.pop("event")
        if not bool(item.pop("finite")):
            values = decode_features(item["hidden"], item["hidden_scale"]).float()
            bad_tok = (~torch.isfinite(values)).any(-1).nonzero()[0, 0].item()
            k = bisect.bisect_right(np.cumsum(item["lengths"]).tolist(), bad_tok)
            where = f" ({item['where'][k]})" if item.get("where") else ""
            raise ShardWriteError(f"the target produced NaN/Inf features for sample {item['sample_index'][k]}{where}; "
                                  "nothing of that batch was written. Load the target in bfloat16 or float32 "
                                  "(float16 overflows in many models) and run again with --resume")
        if item.get("counts"):
            self.manifest.update(item.pop("counts"))
        self.pending.append(item)
        self.pending_bytes += sum(t.numel() * t.element_size() for k, t in item.items()
                                  if isinstance(t, torch.Tensor))
        if self.pending_bytes >= self.shard_bytes:
            self._write_shard()

    def _write_shard(self):
        import safetensors.torch

        items, self.pending, self.pending_bytes = self.pending, [], 0
        lengths = [n for it in items for n in it["lengths"]]
        tensors = {"sample_index": torch.tensor([i for it in items for i in it["sample_index"]], dtype=torch.int64),
                   "offsets": torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int64)}
        for key in ("input_ids", "loss_mask", "hidden", "hidden_scale", "last_hidden", "last_hidden_scale"):
            if items[0].get(key) is not None:
                tensors[key] = torch.cat([it[key] for it in items]).contiguous()
        name = shard_name(self.rank, self.seq)
        data = safetensors.torch.save(tensors, metadata={"format": "dflashkit-shard", "codec": self.codec,
                                                         "schema_version": str(SCHEMA_VERSION)})
        try:
            atomic_write(self.dir / name, data, pause_name=f"shard-{self.seq}-written")
            pause_point(f"shard-{self.seq}-renamed")
        except OSError as e:
            raise ShardWriteError(
                f"could not write shard {self.dir / name} ({len(data)} bytes): {e.strerror or e} "
                f"[errno {e.errno}]. The manifest lists only complete shards; free disk space (or raise the "
                f"file-size limit) and run the same command with --resume") from e
        self.manifest["shards"].append({
            "file": name, "rank": self.rank, "seq": self.seq, "samples": len(lengths), "tokens": int(sum(lengths)),
            "loss_tokens": int(tensors["loss_mask"].sum()), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "sample_indices": tensors["sample_index"].tolist()})
        update_totals(self.manifest)
        write_manifest(self.manifest_path, self.manifest)
        pause_point(f"shard-{self.seq}-listed")
        self.seq += 1


def prepare_resume(out_dir, rank: int, world_size: int) -> dict | None:
    """This rank's manifest so far (None: nothing done) after removing leftovers of a killed run."""
    out_dir = Path(out_dir)
    part = out_dir / rank_manifest_name(rank, world_size)
    manifest = None
    if part.exists():
        manifest = json.loads(part.read_text())
    elif (out_dir / MANIFEST).exists():
        manifest = json.loads((out_dir / MANIFEST).read_text())
        manifest["shards"] = [s for s in manifest["shards"] if s["rank"] == rank]
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
