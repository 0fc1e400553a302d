"""Untrusted shard manifests: a copy of the tiny run's shards, a manifest edited in place, `dflashkit train`'s
arguments over them, and the one error line a refused command prints."""

import json
import shutil
from pathlib import Path

from .training import tiny_overrides


def copy_shards(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run's shard directory in ``tmp_path``/shards, free to edit."""
    _, shards = tiny_run
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    return copy


def edit_manifest(directory: Path, change) -> dict:
    """Apply ``change`` to ``directory``/manifest.json (it edits in place, or returns a new top level: a list)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    replaced = change(manifest)
    manifest = replaced if isinstance(replaced, list) else manifest
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def train_argv(shards: Path, out: Path) -> list[str]:
    """`dflashkit train` over ``shards`` into ``out`` with the tiny run's settings."""
    fields = tiny_overrides(shards, out)
    return ["train", *(f"{k}={json.dumps(v) if isinstance(v, (dict, list, bool)) else v}" for k, v in fields.items())]


def one_error_line(stderr: str, prog: str) -> str:
    """The last line of ``stderr``, checked to be ``prog``'s one-line user error (no traceback)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and lines and lines[-1].startswith(f"{prog}: error: "), stderr[-2000:]
    return lines[-1]
