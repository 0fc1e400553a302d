"""The shard reader: the samples of a shard directory as a dataset, each read from memory-mapped files.

Design choices:
- Each shard is memory-mapped (``format.MappedShard``, which parses the safetensors header itself) and one sample's
  rows are copied out per item: a 100 GB directory costs no memory until read.
- Before any sample is read, every listed shard is checked against its manifest entry (present, its size, its
  sample count), so a damaged directory fails naming the file and ``dflashkit verify``.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from dflashkit.errors import UserError

from .format import MappedShard, decode_features
from .manifest import MANIFEST, read_manifest, shard_path


class ShardDataset(torch.utils.data.Dataset):
    """Samples of a shard directory: ``ds[i]`` -> dict(input_ids, loss_mask, hidden[, last_hidden], sample_index).

    Reads only the requested sample's bytes (memory-mapped). ``hidden`` is bf16 [T, K*H] (fp8 decoded).
    Samples are numbered in the order of their ``sample_index`` (their order in the source data), whatever order
    extraction wrote them in (it batches by length, several ranks interleave): ``ds[i]`` of a shard directory is
    the i-th sample online training reads from the same data, so both paths split, shuffle and anchor alike.
    A directory whose extraction has not finished is refused unless ``allow_incomplete``.
    """

    def __init__(self, path, allow_incomplete: bool = False):
        self.dir = Path(path)
        self.manifest = read_manifest(self.dir)
        if not self.manifest.get("complete", False) and not allow_incomplete:
            raise UserError(f"{self.dir}: the extraction has not finished (manifest complete=false); finish it: "
                            f"run the `dflashkit extract` command that wrote it again, with --resume")
        self.shards, self._starts, self._offsets = [], [], []
        lengths, indices = [], []  # in file order
        for k, entry in enumerate(self.manifest["shards"]):
            path = shard_path(self.dir, entry, k)
            if not path.exists():
                raise UserError(f"{path} is listed in {self.dir / MANIFEST} but missing; "
                                f"run `dflashkit verify {self.dir}`")
            if path.stat().st_size != entry["bytes"]:
                raise UserError(f"{path}: {path.stat().st_size} bytes, {self.dir / MANIFEST} says "
                                f"{entry['bytes']} (truncated or replaced); run `dflashkit verify {self.dir}`")
            shard = MappedShard(path)
            offsets = shard.array("offsets").astype(np.int64)
            if len(offsets) != entry["samples"] + 1:
                raise UserError(f"{path}: {len(offsets) - 1} samples, the manifest says {entry['samples']}; "
                                f"run `dflashkit verify {self.dir}`")
            self._starts.append(len(lengths))
            self.shards.append(shard)
            self._offsets.append(offsets)
            lengths += np.diff(offsets).tolist()
            indices += shard.array("sample_index").tolist()
        self._order = np.argsort(np.asarray(indices, dtype=np.int64), kind="stable")  # dataset i -> file position
        self.lengths = [lengths[j] for j in self._order]
        self.sample_indices = [indices[j] for j in self._order]
        self.has_last_hidden = bool(self.shards) and "last_hidden" in self.shards[0].table

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        i %= len(self)
        j = int(self._order[i])  # where the sample lies in the files
        s = bisect.bisect_right(self._starts, j) - 1
        shard, local = self.shards[s], j - self._starts[s]
        lo, hi = int(self._offsets[s][local]), int(self._offsets[s][local + 1])
        out = {"input_ids": shard.tensor("input_ids", lo, hi).long(),
               "loss_mask": shard.tensor("loss_mask", lo, hi).bool(),
               "sample_index": self.sample_indices[i]}
        for key in ("hidden", "last_hidden"):
            if key in shard.table:
                scale = shard.tensor(f"{key}_scale", lo, hi) if f"{key}_scale" in shard.table else None
                out[key] = decode_features(shard.tensor(key, lo, hi), scale)
        return out
