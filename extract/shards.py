"""Feature shards on disk: the format, the codec, the manifest, and a memory-mapped reader.

Design choices:
- A shard is one safetensors file holding many samples concatenated on the token axis: ``hidden`` [N, K*H],
  ``input_ids`` int32 [N], ``loss_mask`` bool [N], ``offsets`` int64 [S+1], ``sample_index`` int64 [S] (each
  sample's stable index in the data), optionally ``last_hidden`` [N, H]. Never pickle.
- Codecs: ``bf16`` (2 bytes per value, relative error <= 2^-8) and ``fp8`` (e4m3 with one float32 scale per token
  = max|x| / 448, so the largest value of each token maps to the top of the e4m3 range; 1 byte per value + 4 per
  token). fp8 error bound, per element: |x' - x| <= 0.067 |x| + 2.2e-6 max|x_token| (e4m3 rounding: 2^-4
  relative, or half its subnormal step, 2^-10 times the scale; then the bf16 output rounding, 2^-8).
- Shards are written by ``writer.ShardWriter`` (durably, ``files``; on background threads) straight from the host
  buffers the features were copied into: the safetensors header is built here and the tensors' bytes follow it;
  their sha256 is computed from the same buffers on another thread. The manifest is rewritten atomically after
  every shard and lists only complete shards, one shard per line (``manifest_text``; any JSON of the same
  content reads the same, so manifests written indented by earlier versions load too).
- The reader memory-maps each shard (parsing the safetensors header itself) and copies out one sample.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from .files import (
    atomic_write,
    fsync_dir,  # noqa: F401  (imported from here by train)
    pause_point,  # noqa: F401  (imported from here by train)
    sha256_file,  # noqa: F401  (imported from here by train and verify)
)

SCHEMA_VERSION = 1
CODECS = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_REL_ERR, FP8_ABS_ERR = 0.067, 2.2e-6  # the bound stated above (times max|x| of the token for the abs part)
MANIFEST = "manifest.json"
_NP = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F32": np.float32, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}
_TORCH_VIEW = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}


# ---------------------------------------------------------------- codec


def encode_features(x: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, D] features -> (stored values, per-token float32 scale or None)."""
    if codec == "bf16":
        return x.to(torch.bfloat16).contiguous(), None
    if codec != "fp8":
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # |x| exact
    xf = x.float() if x.dtype != torch.float32 else x.clone()  # divided in place: one float32 temporary
    q = xf.div_(scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def decode_features(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored values (+ scale) -> bf16 features."""
    if scale is None:
        return values.to(torch.bfloat16)
    return (values.float() * scale.float()[:, None]).to(torch.bfloat16)


def bytes_per_token(codec: str, feature_dim: int) -> int:
    """Bytes one token's features take on disk (ids, mask and offsets add 5 more)."""
    return 2 * feature_dim if codec == "bf16" else feature_dim + 4


# ---------------------------------------------------------------- manifest


def shard_line(entry: dict) -> str:
    """A shard's entry as its line of the manifest."""
    return json.dumps(entry, separators=(",", ":"))


def manifest_text(manifest: dict, shard_lines: list[str] | None = None) -> str:
    """The manifest as JSON: its fields indented, then ``shards``, one entry per line. ``shard_lines``: the entries'
    lines already made (``shard_line``); the writer keeps them, so rewriting the manifest after a shard encodes
    only the fields, not every shard listed before (at 100k samples encoding them all took ~0.2 s per shard,
    holding the interpreter lock that the forward's thread needs)."""
    if "shards" not in manifest:
        return json.dumps(manifest, indent=1) + "\n"
    lines = shard_lines if shard_lines is not None else [shard_line(s) for s in manifest["shards"]]
    head = json.dumps({k: v for k, v in manifest.items() if k != "shards"}, indent=1)
    shards = '"shards": [\n  ' + ",\n  ".join(lines) + "\n ]" if lines else '"shards": []'
    return (head[:-2] + ",\n " if head != "{}" else "{\n ") + shards + "\n}\n"


def write_manifest(path: Path, manifest: dict, shard_lines: list[str] | None = None) -> None:
    atomic_write(path, manifest_text(manifest, shard_lines).encode())


def read_manifest(path) -> dict:
    """The manifest of a shard directory (or a manifest file)."""
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not file.exists():
        parts = sorted(path.glob("manifest.rank*.json")) if path.is_dir() else []
        hint = ("only per-rank manifests are there: the extraction did not finish; run it again with --resume"
                if parts else "not a dflashkit shard directory (run `dflashkit extract` to make one)")
        raise FileNotFoundError(f"{file} not found: {hint}")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); the file is damaged") from None
    return check_manifest(manifest, file)


# what every manifest entry of a shard holds, and its JSON type
SHARD_FIELDS = {"file": str, "samples": int, "tokens": int, "bytes": int, "sha256": str, "sample_indices": list}


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _check_type(value, kind: type, where: str, fix: str) -> None:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ValueError(f"{where} is {_kind(value)} ({str(value)[:40]!r}), expected {_kind(kind())}; {fix}")


def check_manifest(manifest, file) -> dict:
    """``manifest`` (parsed from ``file``) if it has the fields and types the reader and ``verify`` use; else a
    one-line ValueError naming the file and the field. A manifest is read before any shard is opened, so a
    damaged or foreign one stops here rather than deep inside the reader."""
    fix = "the manifest is damaged or not written by dflashkit; re-extract"
    if not isinstance(manifest, dict):
        raise ValueError(f"{file}: the top level is {_kind(manifest)}, a manifest is an object; {fix}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{file}: schema_version {manifest.get('schema_version')!r}, this dflashkit reads "
                         f"{SCHEMA_VERSION}; re-extract with this version")
    for key, kind in (("target_layer_ids", list), ("hidden_size", int), ("codec", str), ("shards", list)):
        if key not in manifest:
            raise ValueError(f"{file}: field {key} is missing; {fix}")
        _check_type(manifest[key], kind, f"{file}: field {key}", fix)
    for k, layer in enumerate(manifest["target_layer_ids"]):
        _check_type(layer, int, f"{file}: target_layer_ids[{k}]", fix)
    if manifest["codec"] not in CODECS:
        raise ValueError(f"{file}: codec {manifest['codec']!r} is not one of {CODECS}; {fix}")
    for k, entry in enumerate(manifest["shards"]):
        where = f"{file}: shards[{k}]"
        _check_type(entry, dict, where, fix)
        for key, kind in SHARD_FIELDS.items():
            if key not in entry:
                raise ValueError(f"{where}.{key} is missing; {fix}")
            _check_type(entry[key], kind, f"{where}.{key}", fix)
        for key in ("samples", "tokens", "bytes"):
            if entry[key] < 0:
                raise ValueError(f"{where}.{key} is {entry[key]}, a count is never negative; {fix}")
        if len(entry["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in entry["sha256"]):
            raise ValueError(f"{where}.sha256 is {entry['sha256'][:70]!r}, expected 64 hex digits; {fix}")
        if len(entry["sample_indices"]) != entry["samples"]:
            raise ValueError(f"{where}.sample_indices lists {len(entry['sample_indices'])} samples, samples says "
                             f"{entry['samples']}; {fix}")
        for i in entry["sample_indices"]:
            _check_type(i, int, f"{where}.sample_indices", fix)
    return manifest


def shard_path(directory, entry: dict, k: int, manifest_file=None) -> Path:
    """The file of the manifest's ``k``-th shard ``entry``, kept inside ``directory`` (dflashkit/untrusted.py)."""
    from dflashkit.untrusted import contained_file

    return contained_file(directory, entry["file"], source=manifest_file or Path(directory) / MANIFEST,
                          field=f"shards[{k}].file")


def shard_name(rank: int, seq: int) -> str:
    return f"shard-r{rank:03d}-{seq:06d}.safetensors"


def rank_manifest_name(rank: int, world_size: int) -> str:
    return MANIFEST if world_size == 1 else f"manifest.rank{rank}.json"


TOTALLED = ("samples", "tokens", "loss_tokens", "bytes")  # summed over the shards into the manifest's totals


def totals(sums: dict) -> dict:
    """The manifest's ``totals`` from the shards' count and the sums of ``TOTALLED``."""
    return {**{k: sums[k] for k in ("shards", *TOTALLED)},
            "bytes_per_token": round(sums["bytes"] / sums["tokens"], 2) if sums["tokens"] else None}


def update_totals(manifest: dict) -> None:
    shards = manifest["shards"]
    manifest["totals"] = totals({"shards": len(shards), **{k: sum(s[k] for s in shards) for k in TOTALLED}})


_DTYPE_NAME = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.int32: "I32",
               torch.int64: "I64", torch.bool: "BOOL"}


def safetensors_parts(tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> list:
    """A safetensors file as a list of buffers (header bytes, then each tensor's bytes), without joining them.

    ``tensors``: name -> row blocks (contiguous CPU tensors of one dtype, equal trailing shape), stored as their
    concatenation on dim 0. Tensors are laid out largest element first, then by name (as safetensors does), so
    each starts aligned; the header is padded with spaces to 8 bytes. The file is what ``safetensors.torch.save``
    writes for the concatenated tensors, up to the order of the keys inside the header."""
    order = sorted(tensors, key=lambda k: (-tensors[k][0].element_size(), k))
    header: dict = {"__metadata__": metadata}
    views, offset = [], 0
    for name in order:
        blocks = tensors[name]
        nbytes = sum(b.numel() * b.element_size() for b in blocks)
        shape = [sum(b.shape[0] for b in blocks), *blocks[0].shape[1:]]
        header[name] = {"dtype": _DTYPE_NAME[blocks[0].dtype], "shape": shape,
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views += [b.reshape(-1).view(torch.uint8).numpy() for b in blocks if b.numel()]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [struct.pack("<Q", len(head)) + head, *views]


# ---------------------------------------------------------------- reader


def read_shard_header(path) -> tuple[dict, int, dict]:
    """(tensor table {name: (dtype, shape, start, end)} with absolute offsets, file size, metadata)."""
    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes): damaged or truncated")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e}): damaged") from None
    meta = header.pop("__metadata__", {}) or {}
    table = {}
    for name, info in header.items():
        start, end = (8 + n + o for o in info["data_offsets"])
        if info["dtype"] not in _NP or end > size or start > end:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']}, bytes {start}..{end}) does not fit the "
                             f"file ({size} bytes): truncated or damaged")
        table[name] = (info["dtype"], tuple(info["shape"]), start, end)
    return table, size, meta


class _MappedShard:
    """One shard file, memory-mapped; tensors are numpy views into the map."""

    def __init__(self, path: Path):
        self.path = path
        self.table, _, self.meta = read_shard_header(path)
        self._mm = None

    def array(self, name: str) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype, shape, start, end = self.table[name]
        return self._mm[start:end].view(_NP[dtype]).reshape(shape)

    def tensor(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Rows lo:hi of a tensor, copied out of the map."""
        t = torch.from_numpy(np.array(self.array(name)[lo:hi], copy=True))
        view = _TORCH_VIEW.get(self.table[name][0])
        return t.view(view) if view is not None else t

    def __getstate__(self):  # DataLoader workers reopen the map instead of pickling it
        return {**self.__dict__, "_mm": None}


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
            raise ValueError(f"{self.dir}: the extraction has not finished (manifest complete=false); finish it "
                             "with `dflashkit extract ... --resume`, or pass allow_incomplete=True")
        self.shards, self._starts, self._offsets = [], [], []
        lengths, indices = [], []  # in file order
        for k, entry in enumerate(self.manifest["shards"]):
            path = shard_path(self.dir, entry, k)
            if not path.exists():
                raise FileNotFoundError(f"{path} is listed in {self.dir / MANIFEST} but missing; "
                                        f"run `dflashkit verify {self.dir}`")
            if path.stat().st_size != entry["bytes"]:
                raise ValueError(f"{path}: {path.stat().st_size} bytes, {self.dir / MANIFEST} says "
                                 f"{entry['bytes']} (truncated or replaced); run `dflashkit verify {self.dir}`")
            shard = _MappedShard(path)
            offsets = shard.array("offsets").astype(np.int64)
            if len(offsets) != entry["samples"] + 1:
                raise ValueError(f"{path}: {len(offsets) - 1} samples, the manifest says {entry['samples']}; "
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


def check_manifest_matches(manifest: dict, drafter_config, target_identity: dict | None = None) -> None:
    """Raise ValueError naming the field where shards and a drafter config (and target) disagree."""
    def get(obj, key):
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    checks = [("target_layer_ids", lambda v: [int(x) for x in v]), ("hidden_size", int),
              ("num_target_layers", int), ("vocab_size", int)]
    for key, norm in checks:
        mine, theirs = get(drafter_config, key), manifest.get(key)
        if mine is None or theirs is None:
            continue
        if norm(mine) != norm(theirs):
            raise ValueError(f"{key}: the shards were extracted with {key}={theirs} but the drafter config has "
                             f"{key}={mine}; re-extract with matching settings or build the drafter with "
                             f"{key}={theirs}")
    for key in ("config_hash", "weights_hash", "tokenizer_hash"):
        mine = (target_identity or {}).get(key)
        theirs = manifest.get(key) if key == "tokenizer_hash" else manifest.get("target", {}).get(key)
        if mine and theirs and mine != theirs:
            where = key if key == "tokenizer_hash" else f"target.{key}"
            raise ValueError(f"{where}: the shards come from a different target ({theirs[:12]}... vs this "
                             f"target's {mine[:12]}..., extracted from {manifest.get('target', {}).get('path')}); "
                             "train with the target the shards were extracted from, or re-extract")
