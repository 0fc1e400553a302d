"""The shard file format: what a shard holds, the feature codec, and the safetensors layout written and read.

Design choices:
- A shard is one safetensors file holding many samples concatenated on the token axis: ``hidden`` [N, K*H],
  ``input_ids`` int32 [N], ``loss_mask`` bool [N], ``offsets`` int64 [S+1], ``sample_index`` int64 [S] (each
  sample's stable index in the data), optionally ``last_hidden`` [N, H]. Never pickle.
- Codecs: ``bf16`` (2 bytes per value, relative error <= 2^-8) and ``fp8`` (e4m3 with one float32 scale per token
  = max|x| / 448, so the largest value of each token maps to the top of the e4m3 range; 1 byte per value + 4 per
  token). fp8 error bound, per element: |x' - x| <= 0.067 |x| + 2.2e-6 max|x_token| (e4m3 rounding: 2^-4
  relative, or half its subnormal step, 2^-10 times the scale; then the bf16 output rounding, 2^-8).
- Shards are written by ``writer.ShardWriter`` (durably, ``dflashkit/files.py``; on background threads) straight
  from the host buffers the features were copied into: the safetensors header is built here
  (``safetensors_parts``) and the tensors' bytes follow it; their sha256 is computed from the same buffers on
  another thread.
- Reading parses the safetensors header here too (``read_shard_header``, every offset checked against the file's
  size) and memory-maps the file (``MappedShard``); the reader (``reader.py``) and ``verify`` share both.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from dflashkit.errors import UserError

CODECS = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_REL_ERR, FP8_ABS_ERR = 0.067, 2.2e-6  # the bound stated above (times max|x| of the token for the abs part)
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


# ---------------------------------------------------------------- the safetensors layout


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


# ---------------------------------------------------------------- reading a shard file


def read_shard_header(path) -> tuple[dict, int, dict]:
    """(tensor table {name: (dtype, shape, start, end)} with absolute offsets, file size, metadata)."""
    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: {size} bytes, too short for a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise UserError(f"{path}: header length {n} does not fit the file ({size} bytes): damaged or truncated")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: unreadable safetensors header ({e}): damaged") from None
    meta = header.pop("__metadata__", {}) or {}
    table = {}
    for name, info in header.items():
        start, end = (8 + n + o for o in info["data_offsets"])
        if info["dtype"] not in _NP or end > size or start > end:
            raise UserError(f"{path}: tensor {name!r} ({info['dtype']}, bytes {start}..{end}) does not fit the "
                            f"file ({size} bytes): truncated or damaged")
        table[name] = (info["dtype"], tuple(info["shape"]), start, end)
    return table, size, meta


class MappedShard:
    """One shard file, memory-mapped: ``table`` (name -> (dtype, shape, start, end)) and ``meta`` from its header;
    ``array`` gives numpy views into the map, ``tensor`` a copy of some rows as a torch tensor."""

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
