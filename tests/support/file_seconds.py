"""Seconds each test file takes, for sending the longest files to the workers first (tests/conftest.py).

`make test` runs one file per xdist worker at a time (``--dist loadfile``): the suite ends when the last worker
ends, so a long file started last decides the wall time. Sorting the files longest first (and telling xdist to
keep that order, ``--no-loadscope-reorder``) keeps the workers' ends close. The seconds come from a measured run:

    .venv/bin/python -m pytest -q -n auto --dist loadfile tests --junitxml=/tmp/junit.xml
    .venv/bin/python tests/support/file_seconds.py /tmp/junit.xml > tests/file_seconds.json

A file missing from the list (a new one) counts as the median file; a stale list only costs balance, never a
result.
"""

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SECONDS_FILE = Path(__file__).parents[1] / "file_seconds.json"


def file_of(classname: str) -> str:
    """The test file of a junit ``classname`` (``tests.unit.x.test_y`` or ``tests.unit.x.test_y.TestZ``)."""
    parts = classname.split(".")
    last = max(i for i, part in enumerate(parts) if part.startswith("test_"))
    return "/".join(parts[:last + 1]) + ".py"


def seconds_per_file(junit_xml: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        name = file_of(case.get("classname", ""))
        totals[name] = totals.get(name, 0.0) + float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The measured seconds per file (empty when there is no list or it cannot be read: the order is then
    pytest's own)."""
    try:
        seconds = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in seconds.items()} if isinstance(seconds, dict) else {}


def longest_first(paths: list[str], seconds: dict[str, float]) -> list[str]:
    """``paths`` (test files, in pytest's order) sorted by measured seconds, longest first; a file without a
    measurement counts as the median one; ties keep pytest's order."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    return sorted(paths, key=lambda p: -seconds.get(p, default))


if __name__ == "__main__":
    print(json.dumps(seconds_per_file(sys.argv[1]), indent=1))
