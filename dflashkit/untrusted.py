"""File names read from files that someone else may have written: a shard manifest's ``file`` entries, a drafter
index's ``weight_map``. A name from such a file may only point inside its own directory.

The rule (``contained_file``):
- the name is a non-empty relative path (a string) with no ``..`` part and no NUL byte;
- followed through every symlink, it stays inside the directory (a link to /etc/passwd or to a sibling directory
  is refused). One layout is allowed to link out: a Hugging Face hub snapshot (``.../snapshots/REV/``), whose
  files are links into the same repository's ``blobs/`` directory;
- when it exists, it is a regular file: a device (/dev/zero), a FIFO or a directory is refused, since reading one
  may never end.
A missing file is not an error here: the caller knows what a missing file means (``verify`` lists it).

This module imports only ``dflashkit.errors``, so every package (``drafter/`` included) may use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from dflashkit.errors import UserError


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blobs(directory: str) -> str | None:
    """The ``blobs`` directory of a hub snapshot directory ``.../snapshots/REV``, else None."""
    parent = os.path.dirname(directory)
    if os.path.basename(parent) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    return blobs if os.path.isdir(blobs) else None


def contained_file(directory, name, *, source, field: str) -> Path:
    """``directory / name`` after checking that ``name`` (read from ``source``, at ``field``) stays inside
    ``directory`` and, when it exists, is a regular file. UserError (one line naming ``source`` and ``field``)
    otherwise."""
    where = f"{source}: {field}"
    if not isinstance(name, str) or not name:
        raise UserError(f"{where} is {name!r}, expected a file name; the file is damaged or not written by dflashkit")
    parts = set(PurePosixPath(name).parts) | set(PureWindowsPath(name).parts)
    if "\0" in name or os.path.isabs(name) or PureWindowsPath(name).anchor or ".." in parts:
        raise UserError(f"{where} is {name!r}: a listed file must be a relative name inside {directory} "
                        "(no '..', no absolute path); the file was not written by dflashkit and is not read")
    path = Path(directory) / name
    root = os.path.realpath(directory)
    real = os.path.realpath(path)
    if not _inside(real, root):
        blobs = _hub_blobs(os.path.abspath(directory)) or _hub_blobs(root)
        if blobs is None or not _inside(real, os.path.realpath(blobs)):
            raise UserError(f"{where} is {name!r}, which resolves to {real}, outside {directory}; a listed file "
                            "must lie inside its directory (copy the file in instead of linking it)")
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError as e:  # a dangling link or an unreadable entry
            raise UserError(f"{where}: {path} cannot be read ({e.strerror or e}); the file is missing or damaged") \
                from None
        if not stat.S_ISREG(mode):
            raise UserError(f"{where}: {path} is not a regular file (a device, pipe or directory is never read); "
                            "the file is damaged or not written by dflashkit")
    return path
