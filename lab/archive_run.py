"""Keep a run's raw output in the repository as one compressed archive plus a small summary JSON, and the index
of all of them (lab/results/INDEX.md).

    python -m lab.archive_run RUN_DIR --measured "what the run measured" [--card "NVIDIA H100 80GB HBM3"]
        [--date 2026-12-07] [--results lab/results]

RUN_DIR (a folder, or a single result file) becomes ``RESULTS/NAME.tar.xz`` (members under ``NAME/``, or the file
itself) and ``RESULTS/NAME.json`` (run, date, card, what it measured, the archive, its members and their bytes);
INDEX.md is then written anew from every summary. A document names a file inside an archive as
``lab/results/NAME.tar.xz:MEMBER``; ``tar -xJf lab/results/NAME.tar.xz MEMBER`` extracts it.

Design choices:
- One archive per run, not a tree of files: a run's hundreds of logs and JSON files are one tracked file, read
  only when someone goes back to it; the summary keeps what the index needs without opening it.
- The archive is reproducible (members sorted, mtime, owner and mode fixed), so archiving the same run twice
  changes nothing in git.
- The card is read from the files when not given: the most frequent ``NVIDIA H...`` name that the benchmarks
  record (torch.cuda.get_device_name), else "h100"/"h200"/"cpu" in the run's name, else "unrecorded".
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
import sys
import tarfile
import time
from pathlib import Path

from dflashkit.errors import UserError

RESULTS = Path(__file__).resolve().parent / "results"
CARD_NAME = re.compile(rb"NVIDIA H\d00(?: 80GB HBM3)?")


def run_files(source: Path) -> list[Path]:
    """Every file of the run, sorted (the file itself for a single-file run)."""
    if source.is_file():
        return [source]
    return sorted(p for p in source.rglob("*") if p.is_file())


def member_name(source: Path, path: Path) -> str:
    """The name of ``path`` inside the archive: NAME/relative path for a folder, the file's name for a file."""
    if source.is_file():
        return source.name
    return f"{source.name}/{path.relative_to(source).as_posix()}"


def detect_card(source: Path, files: list[Path]) -> str:
    """The GPU the run's files name most often, else one named in the run's name, else "unrecorded"."""
    seen = collections.Counter(m.decode() for p in files for m in CARD_NAME.findall(p.read_bytes()))
    if seen:
        return seen.most_common(1)[0][0]
    for word, card in (("h100", "NVIDIA H100"), ("h200", "NVIDIA H200"), ("cpu", "CPU")):
        if word in source.name.lower():
            return card
    return "unrecorded"


def write_archive(source: Path, files: list[Path], archive: Path) -> None:
    """``files`` as a reproducible xz tar at ``archive`` (written beside it, then renamed)."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(member_name(source, path))
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(archive)


def archive_run(source: Path, results: Path, measured: str, date: str | None = None,
                card: str | None = None) -> dict:
    """Archive the run at ``source`` into ``results``; returns (and writes) its summary."""
    if not source.exists():
        raise UserError(f"{source}: no such run folder or file; give the folder the run wrote")
    files = run_files(source)
    if not files:
        raise UserError(f"{source}: the run folder holds no files; nothing to archive")
    name = source.name.split(".")[0] if source.is_file() else source.name
    results.mkdir(parents=True, exist_ok=True)
    archive = results / f"{name}.tar.xz"
    write_archive(source, files, archive)
    summary = {"run": name, "date": date or time.strftime("%Y-%m-%d"), "card": card or detect_card(source, files),
               "measured": measured, "archive": archive.name,
               "members": {member_name(source, p): p.stat().st_size for p in files}}
    (results / f"{name}.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def write_index(results: Path) -> Path:
    """INDEX.md of ``results``: one row per summary JSON, newest first."""
    summaries = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    summaries.sort(key=lambda s: (s["date"], s["run"]), reverse=True)
    lines = ["# Raw results of the lab's runs", "",
             "One archive per run and its summary (`NAME.json`); written by `python -m lab.archive_run`. A document",
             "names a file inside an archive as `lab/results/NAME.tar.xz:MEMBER`; extract it with",
             "`tar -xJf lab/results/NAME.tar.xz MEMBER`.", "",
             "| run | date | card | what it measured | archive | files |", "|---|---|---|---|---|---|"]
    for s in summaries:
        what = s["measured"].replace("|", "/")
        what = what if len(what) <= 140 else what[:139] + "…"
        lines.append(f"| {s['run']} | {s['date']} | {s['card']} | {what} | [{s['archive']}]({s['archive']}) "
                     f"| {len(s['members'])} |")
    index = results / "INDEX.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run's folder (or single result file)")
    ap.add_argument("--measured", required=True, help="one line: what the run measured")
    ap.add_argument("--date", default=None, help="the run's date, YYYY-MM-DD (default: today)")
    ap.add_argument("--card", default=None, help="the GPU (default: read from the run's files)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of archives (default: lab/results)")
    args = ap.parse_args(argv)
    try:
        summary = archive_run(args.run, args.results, args.measured, args.date, args.card)
    except UserError as e:
        print(f"archive_run: error: {e}", file=sys.stderr)
        return 2
    write_index(args.results)
    print(f"{summary['run']}: {len(summary['members'])} files -> {args.results / summary['archive']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
