"""The GGUF cache: a ``.gguf`` target (a user's file or a testbed's) dequantized once into a float32 safetensors
directory that every stage then loads like any HF model directory (targets/loading.py ``resolve_target_dir``).

Design choices:

- The cache lives under ``$DFLASHKIT_CACHE`` (default ``~/.cache/dflashkit``); a user's file is keyed by its
  absolute path, size and modification time, a testbed by its name. A conversion is written into a temporary
  directory and renamed into place (the directory shape of dflashkit/files.py), so a crash never leaves a
  half-written cache, and a marker file records the source it was made from, so a changed source is converted
  again.
- float32 keeps the dequantized values exactly, so every stage, whatever dtype it loads, sees one copy with one
  identity. Everything downstream reads safetensors: one loader, one identity hash, and ``load_target_head`` works
  for GGUF targets as well. (Disk: 4 bytes per parameter.)
- One process converts at a time (``conversion_lock``): the ranks of one launch, or a regeneration beside a
  warm-up run, wait for the first conversion and reuse it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import UserError
from dflashkit.files import disk_full_errno, disk_full_error, rename_dir_into_place

_SOURCE_MARKER = "dflashkit-source.json"  # written into a converted GGUF cache directory


def cache_root() -> Path:
    """$DFLASHKIT_CACHE, else ~/.cache/dflashkit."""
    return Path(os.environ.get("DFLASHKIT_CACHE") or Path.home() / ".cache" / "dflashkit")


def gguf_cache_dir(gguf: Path) -> Path:
    """Where a user's GGUF file is converted: keyed by its absolute path, size and modification time."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def _marker_matches(marker: Path, source: dict) -> bool:
    try:
        return json.loads(marker.read_text()) == source
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def conversion_lock(out: Path):
    """Held while ``out`` is converted: a second process that needs the same conversion (the ranks of one launch,
    a regeneration beside a warm-up run, on a fresh cache) waits for the first and then finds it done, instead of
    converting again and failing to rename its copy onto the finished one. The lock file sits beside ``out``;
    where the file system has no flock nothing waits (the rename below then takes the first finished copy)."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield  # closing the file drops the lock


def cached_gguf_conversion(gguf: Path, out: Path) -> Path:
    """Dequantize `gguf` once into `out` (float32 safetensors + tokenizer); reuse it while the source is unchanged.

    float32 holds every dequantized GGUF value exactly, so the cache is a faithful copy whatever dtype a stage
    loads it in, and one copy (one identity) serves them all. One process converts at a time (conversion_lock)."""
    if not gguf.is_file():
        raise UserError(f"GGUF file {gguf} is missing; reinstall the package that ships it")
    source = {"gguf": gguf.name, "size": gguf.stat().st_size, "storage_dtype": "float32"}
    marker = out / _SOURCE_MARKER
    if _marker_matches(marker, source):
        return out
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading {gguf.name} needs the gguf package: pip install gguf")
    try:
        with conversion_lock(out):
            if not _marker_matches(marker, source):  # else another process converted it while this one waited
                _convert_gguf(gguf, out, source)
    except OSError as error:
        if disk_full_errno(error) is not None:
            raise disk_full_error(error.errno, out, then="run the command again (or set DFLASHKIT_CACHE to a "
                                                         "directory with room)") from error
        if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST):
            raise
        raise UserError(f"{out}: the converted target cannot be written there ({error.strerror}: "
                        f"{error.filename}); set DFLASHKIT_CACHE to a writable directory (the GGUF is converted "
                        f"once into it; unset, it is {Path.home() / '.cache' / 'dflashkit'})") from None
    return out


def _convert_gguf(gguf: Path, out: Path, source: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = out / _SOURCE_MARKER
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        kwargs: dict[str, Any] = {}
        try:  # transformers >= 5.2x keeps GGUF blocks packed unless told to dequantize
            from transformers import GgufConfig

            if "dequantize" in inspect.signature(GgufConfig.__init__).parameters:
                kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs)
        # the weights are dequantized now: save them as plain tensors, without the GGUF quantization config
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_MARKER).write_text(json.dumps(source, indent=1))
        if not _marker_matches(marker, source):  # else a process without the lock (no flock) finished first
            if out.exists():  # a conversion of an older source file
                shutil.rmtree(out)
            try:
                rename_dir_into_place(tmp, out)  # fsynced, renamed, the rename made durable (dflashkit/files.py)
            except OSError:
                if not _marker_matches(marker, source):  # the same race, between the check and the rename
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
