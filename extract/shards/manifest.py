"""The manifest of a shard directory: what it lists, how it is written and read, and the checks made on it.

Design choices:
- ``manifest.json`` is rewritten atomically after every shard (``dflashkit/files.py``) and lists only complete
  shards, one shard per line (``manifest_text``; any JSON of the same content reads the same, so manifests written
  indented by earlier versions load too).
- A manifest is untrusted input: ``check_manifest`` checks its fields and types when it is read, before any shard
  is opened, and ``shard_path`` keeps every listed file inside the directory (``dflashkit/untrusted.py``).
- ``check_manifest_matches``: training refuses shards whose manifest disagrees with its drafter config or target,
  naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.files import atomic_write

from .format import CODECS

SCHEMA_VERSION = 1  # the manifest layout this version writes and reads; another one is refused
MANIFEST = "manifest.json"  # the manifest's file name inside a shard directory


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
        raise UserError(f"{file} not found: {hint}")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not valid JSON ({e}); the file is damaged") from None
    return check_manifest(manifest, file)


# what every manifest entry of a shard holds, and its JSON type
SHARD_FIELDS = {"file": str, "samples": int, "tokens": int, "bytes": int, "sha256": str, "sample_indices": list}


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _check_type(value, kind: type, where: str, fix: str) -> None:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise UserError(f"{where} is {_kind(value)} ({str(value)[:40]!r}), expected {_kind(kind())}; {fix}")


def check_manifest(manifest, file) -> dict:
    """``manifest`` (parsed from ``file``) if it has the fields and types the reader and ``verify`` use; else a
    one-line UserError naming the file and the field. A manifest is read before any shard is opened, so a
    damaged or foreign one stops here rather than deep inside the reader."""
    fix = "the manifest is damaged or not written by dflashkit; re-extract"
    if not isinstance(manifest, dict):
        raise UserError(f"{file}: the top level is {_kind(manifest)}, a manifest is an object; {fix}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{file}: schema_version {manifest.get('schema_version')!r}, this dflashkit reads "
                        f"{SCHEMA_VERSION}; re-extract with this version")
    for key, kind in (("target_layer_ids", list), ("hidden_size", int), ("codec", str), ("shards", list)):
        if key not in manifest:
            raise UserError(f"{file}: field {key} is missing; {fix}")
        _check_type(manifest[key], kind, f"{file}: field {key}", fix)
    for k, layer in enumerate(manifest["target_layer_ids"]):
        _check_type(layer, int, f"{file}: target_layer_ids[{k}]", fix)
    if manifest["codec"] not in CODECS:
        raise UserError(f"{file}: codec {manifest['codec']!r} is not one of {CODECS}; {fix}")
    for k, entry in enumerate(manifest["shards"]):
        where = f"{file}: shards[{k}]"
        _check_type(entry, dict, where, fix)
        for key, kind in SHARD_FIELDS.items():
            if key not in entry:
                raise UserError(f"{where}.{key} is missing; {fix}")
            _check_type(entry[key], kind, f"{where}.{key}", fix)
        for key in ("samples", "tokens", "bytes"):
            if entry[key] < 0:
                raise UserError(f"{where}.{key} is {entry[key]}, a count is never negative; {fix}")
        if len(entry["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in entry["sha256"]):
            raise UserError(f"{where}.sha256 is {entry['sha256'][:70]!r}, expected 64 hex digits; {fix}")
        if len(entry["sample_indices"]) != entry["samples"]:
            raise UserError(f"{where}.sample_indices lists {len(entry['sample_indices'])} samples, samples says "
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



def check_manifest_matches(manifest: dict, drafter_config, target_identity: dict | None = None) -> None:
    """Raise UserError naming the field where shards and a drafter config (and target) disagree."""
    def get(obj, key):
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    checks = [("target_layer_ids", lambda v: [int(x) for x in v]), ("hidden_size", int),
              ("num_target_layers", int), ("vocab_size", int)]
    for key, norm in checks:
        mine, theirs = get(drafter_config, key), manifest.get(key)
        if mine is None or theirs is None:
            continue
        if norm(mine) != norm(theirs):
            raise UserError(f"{key}: the shards were extracted with {key}={theirs} but the drafter config has "
                            f"{key}={mine}; re-extract with matching settings or build the drafter with "
                            f"{key}={theirs}")
    for key in ("config_hash", "weights_hash", "tokenizer_hash"):
        mine = (target_identity or {}).get(key)
        theirs = manifest.get(key) if key == "tokenizer_hash" else manifest.get("target", {}).get(key)
        if mine and theirs and mine != theirs:
            where = key if key == "tokenizer_hash" else f"target.{key}"
            raise UserError(f"{where}: the shards come from a different target ({theirs[:12]}... vs this "
                            f"target's {mine[:12]}..., extracted from {manifest.get('target', {}).get('path')}); "
                            "train with the target the shards were extracted from, or re-extract")
