"""``dflashkit verify DIR``: check a shard directory before training on it.

    python -m dflashkit.extract.shards.verify runs/smollm2-shards
    dflashkit verify runs/smollm2-shards

Checks: the manifest's fields and types, its target_layer_ids against the target's layer count (the manifest's, and
the target's config.json when it is on this machine); per shard listed: the file is a regular file inside the
directory (no '..', absolute path or link out), its size and then its sha256 match the manifest (catches
truncation and flipped bytes), the safetensors header fits the file, every tensor has the shape and dtype the
format requires (offsets [S+1] from 0 to N, ids/mask [N], hidden [N, K*H], scales [N] for fp8), the sample
indices equal the manifest's, token ids lie inside the vocabulary, and features hold no NaN/Inf. Across shards:
no sample appears twice, the totals add up, and files the manifest does not list are reported.
Exit code 0 when everything holds, 1 with each failing shard named otherwise (verify ran, and found damage). A
path that is not a shard directory (a .jsonl data file, say, or a directory without manifest.json) is the wrong
argument: one line says what verify expects, exit code 2 (its manifest.json stands for its directory).

Design choice: the checks read shards through the same header parser as the reader, chunk by chunk, so a
100 GB dataset is verified in bounded memory; sha256 is computed on the raw bytes, before any parsing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflashkit.errors import UserError
from dflashkit.files import sha256_file
from dflashkit.options import build_parser as options_parser
from dflashkit.options import option, parse_options

from .format import MappedShard, decode_features, read_shard_header
from .manifest import MANIFEST, read_manifest, shard_path

_CHUNK = 1 << 16  # tokens per NaN/Inf check step


def check_shard(path: Path, entry: dict, manifest: dict) -> list[str]:
    """Problems of one shard (empty list: fine)."""
    if not path.exists():
        return ["missing"]
    size = path.stat().st_size  # checked before hashing: a listed file is a regular file (manifest.shard_path)
    if size != entry["bytes"]:
        return [f"size {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"]
    if sha256_file(path) != entry["sha256"]:
        return ["sha256 differs from the manifest (the file was changed or damaged: a flipped byte?)"]
    try:
        read_shard_header(path)
        shard = MappedShard(path)
    except ValueError as e:
        return [str(e)]
    problems = []
    table = shard.table
    n, s = entry["tokens"], entry["samples"]
    dim = len(manifest["target_layer_ids"]) * manifest["hidden_size"]
    codec_dtype = {"bf16": "BF16", "fp8": "F8_E4M3"}[manifest["codec"]]
    want = {"input_ids": ("I32", (n,)), "loss_mask": ("BOOL", (n,)), "offsets": ("I64", (s + 1,)),
            "sample_index": ("I64", (s,)), "hidden": (codec_dtype, (n, dim))}
    if manifest["codec"] == "fp8":
        want["hidden_scale"] = ("F32", (n,))
    if manifest.get("store_last_hidden"):
        want["last_hidden"] = (codec_dtype, (n, manifest["hidden_size"]))
        if manifest["codec"] == "fp8":
            want["last_hidden_scale"] = ("F32", (n,))
    for name, (dtype, shape) in want.items():
        if name not in table:
            problems.append(f"tensor {name!r} missing")
        elif table[name][:2] != (dtype, shape):
            problems.append(f"tensor {name!r} is {table[name][0]}{list(table[name][1])}, expected {dtype}{list(shape)}")
    if problems:
        return problems
    offsets = shard.array("offsets")
    if offsets[0] != 0 or offsets[-1] != n or (np.diff(offsets) <= 0).any():
        problems.append(f"offsets do not run from 0 to {n} in increasing steps")
    if shard.array("sample_index").tolist() != entry["sample_indices"]:
        problems.append("sample indices differ from the manifest's")
    ids = shard.array("input_ids")
    vocab = manifest.get("vocab_size")
    if len(ids) and (ids.min() < 0 or (vocab and ids.max() >= vocab)):
        problems.append(f"token ids outside the vocabulary [0, {vocab})")
    if int(shard.array("loss_mask").sum()) != entry.get("loss_tokens", int(shard.array("loss_mask").sum())):
        problems.append("loss-mask count differs from the manifest's")
    for key in ("hidden", "last_hidden"):
        if key not in want:
            continue
        for lo in range(0, n, _CHUNK):
            hi = min(n, lo + _CHUNK)
            scale = shard.tensor(f"{key}_scale", lo, hi) if f"{key}_scale" in table else None
            values = decode_features(shard.tensor(key, lo, hi), scale)
            bad = ~torch.isfinite(values).all(-1)
            if scale is not None:
                bad |= ~torch.isfinite(scale)
            if bool(bad.any()):
                tok = lo + int(bad.nonzero()[0, 0])
                k = int(np.searchsorted(offsets, tok, side="right")) - 1
                problems.append(f"{key} holds NaN/Inf (first at token {tok}, sample {entry['sample_indices'][k]})")
                break
    return problems


def target_num_layers(manifest: dict) -> int | None:
    """The decoder layer count of the manifest's target when its config.json is on this machine (an HF directory,
    or the cached conversion of a GGUF / testbed target), else None. Reads only that JSON file."""
    import json

    from dflashkit.targets.gguf_cache import cache_root, gguf_cache_dir

    target = manifest.get("target")
    spec = str(target.get("path") or "") if isinstance(target, dict) else ""
    if not spec:
        return None
    if spec.startswith("testbed:"):
        candidates = [cache_root() / "testbed" / spec.removeprefix("testbed:")]
    elif spec.endswith(".gguf"):
        candidates = [gguf_cache_dir(Path(spec))] if Path(spec).is_file() else []
    else:
        candidates = [Path(spec).expanduser()]
    for directory in candidates:
        try:
            config = json.loads((directory / "config.json").read_text())
            config = config.get("text_config") or config
            return int(config["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def layer_id_problems(manifest: dict, file: Path) -> list[str]:
    """``target_layer_ids`` against the manifest's ``num_target_layers`` and the target's own config."""
    ids = manifest["target_layer_ids"]
    problems = []
    for source, layers in (("its num_target_layers", manifest.get("num_target_layers")),
                           ("its target's config.json", target_num_layers(manifest))):
        if isinstance(layers, int) and not isinstance(layers, bool) and any(not 0 <= i < layers for i in ids):
            problems.append(f"{file}: target_layer_ids {ids} lie outside the {layers} decoder layers of {source} "
                            f"(ids 0..{layers - 1}); the manifest does not fit this target: re-extract")
    return problems


def verify_dataset(path) -> tuple[list[str], list[str]]:
    """(errors, notes) for a shard directory; errors name the shard."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)], []
    errors, notes, seen = [], [], {}
    errors += layer_id_problems(manifest, path / MANIFEST)
    for k, entry in enumerate(manifest["shards"]):
        try:
            file = shard_path(path, entry, k)
        except ValueError as e:  # named outside the directory, or not a regular file: never opened
            errors.append(str(e))
            continue
        for problem in check_shard(file, entry, manifest):
            errors.append(f"{file}: {problem}")
        for i in entry.get("sample_indices", []):
            if i in seen:
                errors.append(f"{path / entry['file']}: sample {i} also in {seen[i]}")
            seen[i] = entry["file"]
    totals = manifest.get("totals", {})
    if totals.get("samples") not in (None, len(seen)) or totals.get("shards") not in (None, len(manifest["shards"])):
        errors.append(f"{path / MANIFEST}: totals {totals} do not add up over the listed shards")
    listed = {e["file"] for e in manifest["shards"]}
    extra = sorted(p.name for p in path.glob("shard-*.safetensors") if p.name not in listed)
    if extra:
        notes.append(f"{len(extra)} shard file(s) not in the manifest (left by a killed run; --resume removes "
                     f"them): {', '.join(extra[:5])}")
    if not manifest.get("complete", False):
        notes.append("the extraction has not finished (complete=false): resume it with --resume")
    return errors, notes


@dataclass
class VerifyOptions:
    """The arguments of ``dflashkit verify``."""

    dir: str = option(flag="dir", help="a shard directory written by `dflashkit extract`")


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, built from its arguments (``VerifyOptions``)."""
    return options_parser(VerifyOptions, prog="dflashkit verify", description=__doc__.split("\n\n")[0], raw=False)


def shard_dir_argument(given: str) -> Path:
    """The shard directory named on the command line (a manifest.json stands for its directory); a one-line
    UserError for anything else, which is not a damaged shard directory but the wrong argument."""
    path = Path(given)
    expects = ("verify checks a shard directory written by `dflashkit extract --out DIR` (manifest.json and "
               "shard-*.safetensors)")
    if path.is_file() and path.name == MANIFEST:
        return path.parent
    if path.is_dir() and (path / MANIFEST).exists():
        return path
    if path.is_dir():
        raise UserError(f"{path}: a directory without {MANIFEST}, not a shard directory; {expects}: give that "
                        f"directory")
    if path.exists():
        raise UserError(f"{path}: a file, not a shard directory; {expects}: give that directory")
    raise UserError(f"{path}: no such directory; {expects}: give that directory")


def main(argv=None) -> int:
    opts = parse_options(VerifyOptions, argv, build_parser())
    directory = str(shard_dir_argument(opts.dir))
    errors, notes = verify_dataset(directory)
    for note in notes:
        print(f"note: {note}")
    for error in errors:
        print(f"FAIL {error}", file=sys.stderr)
    if errors:
        print(f"verify: {len(errors)} problem(s) in {directory}", file=sys.stderr)
        return 1
    m = read_manifest(directory)
    t = m.get("totals", {})
    print(f"verify: OK {directory}: {t.get('shards')} shards, {t.get('samples')} samples, {t.get('tokens')} tokens, "
          f"codec {m['codec']}")
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit verify", main))
