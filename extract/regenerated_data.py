"""What data a regenerate output was made from, so that ``--resume`` on other data is refused.

``<out>.data.json`` beside the output records each --data input's bytes and sha256 (``describe_sources``: the
content, so the same bytes under another path resume). A fresh run (or --overwrite) writes it atomically before
the first row; a resumed run compares the data it is given with it and stops, naming the input that differs.
An output written before this record existed resumes with a note, and gets its record then.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.files import atomic_write


def data_record_path(out: Path) -> Path:
    """The record of the data beside ``out``."""
    return out.with_name(out.name + ".data.json")


def check_or_record_data(out: Path, data: list[str], *, resume: bool, has_rows: bool, rank: int,
                         say=print) -> None:
    """--resume: the data must be the data ``out`` was made from (UserError naming what differs); otherwise rank 0
    records it. ``has_rows``: whether ``out`` holds conversations already (a resume with no record says so)."""
    from dflashkit.extract.data.sources import data_difference, describe_sources

    record = data_record_path(out)
    current = describe_sources(data)
    if resume and record.is_file():
        try:
            saved = json.loads(record.read_text())["data"]
            assert isinstance(saved, list) and all(isinstance(e, dict) for e in saved)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise UserError(f"{record}: not the record of the data that dflashkit regenerate writes; remove it to "
                            f"resume {out} without checking the data") from None
        differs = data_difference(saved, current)
        if differs:
            raise UserError(f"--resume: {out} was regenerated from other data: {differs}; resume with the original "
                            "--data, or start afresh with --overwrite")
        return
    if resume and has_rows and rank == 0:
        say(f"regenerate: note: {out} has no record of the data it was made from (written before dflashkit "
            f"recorded it), so the data was not checked; {record.name} now records this run's")
    if rank == 0:
        atomic_write(record, json.dumps({"data": current}, indent=1).encode())
