"""What a lease run leaves in its run directory, read back: the stage records of RUN/stages.jsonl (lab/lease.py writes
them) as one line per stage, and the results packed into one tar.gz small enough to copy off the machine."""

from __future__ import annotations

import glob
import json
import os
import tarfile
import time
from pathlib import Path

from dflashkit.errors import UserError

ALWAYS = ("stages.jsonl", "plan.json")  # in every archive: a fresh machine resumes from them


def read_records(run_dir: Path) -> list[dict]:
    """Every record of RUN/stages.jsonl; a line cut short by a killed runner is left out."""
    path = run_dir / "stages.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def records(run_dir: Path) -> dict[str, dict]:
    """Stage name -> its last end record."""
    return {r["stage"]: r for r in read_records(run_dir) if r.get("event") == "end"}


def stage_lines(run_dir: Path) -> list[str]:
    """One line per stage, in the order the run met them: its last state (running, ok, failed, timeout, skipped,
    blocked), exit status and seconds."""
    if not (run_dir / "stages.jsonl").is_file():
        raise UserError(f"{run_dir}: no stages.jsonl here; is it the run directory of `python -m lab.lease run`?")
    state: dict[str, str] = {}
    for r in read_records(run_dir):
        name, event = r.get("stage"), r.get("event")
        if event == "start":
            since = time.strftime("%H:%M:%S", time.gmtime(r["time"]))
            state[name] = f"running since {since} UTC ({time.time() - r['time']:.0f} s, limit {r['limit']:g} s)"
        elif event == "end":
            state[name] = f"{r['status']} rc={r['rc']} {r['seconds']:g} s"
        elif event == "skip":
            state[name] = f"skipped ({r['reason']})"
        elif event == "blocked":
            state[name] = f"blocked ({r['reason']})"
    width = max((len(n) for n in state), default=0)
    return [runner_line(run_dir), *(f"{name:<{width}}  {text}" for name, text in state.items())]


def runner_line(run_dir: Path) -> str:
    """Whether the last `lease run` of ``run_dir`` ended (its exit status), runs on, or is gone without an end (the
    machine was reset, or the runner was killed)."""
    runs = [r for r in read_records(run_dir) if r.get("event") in ("run", "done")]
    if not runs or runs[-1]["event"] == "done":
        return f"runner ended rc={runs[-1]['rc']}" if runs else "runner: no run recorded"
    pid = runs[-1]["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"runner pid {pid} gone without an end record"
    except PermissionError:
        pass
    return f"runner pid {pid} running"


def collect(run_dir: Path, out: Path, max_mib: float = 16.0) -> str:
    """RUN's files matching the globs the plan's ``collect`` names (kept in RUN/plan.json), plus stages.jsonl and
    plan.json, packed into ``out`` (tar.gz, paths relative to RUN). Over ``max_mib`` MiB it is removed and the
    largest files are named: a UserError. Returns a one-line summary."""
    plan_json = run_dir / "plan.json"
    if not plan_json.is_file():
        raise UserError(f"{run_dir}: no plan.json here; is it the run directory of `python -m lab.lease run`?")
    globs = json.loads(plan_json.read_text())["collect"]
    files: list[Path] = []
    for pattern in [*ALWAYS, *globs]:
        for hit in sorted(glob.glob(str(run_dir / pattern), recursive=True)):
            path = Path(hit)
            if path.is_file() and path not in files and ".packages" not in path.relative_to(run_dir).parts:
                files.append(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(run_dir)))
    size = out.stat().st_size
    if size > max_mib * 2**20:
        out.unlink()
        largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:3]
        named = ", ".join(f"{p.relative_to(run_dir)} ({p.stat().st_size / 2**20:.1f} MiB)" for p in largest)
        raise UserError(f"{out}: {size / 2**20:.1f} MiB packed, over {max_mib:g} MiB; the largest: {named}; "
                        "narrow the plan's collect globs")
    return f"{out}: {len(files)} files, {size / 2**20:.2f} MiB"
