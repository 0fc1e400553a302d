"""Wall time to a quality, read off a training run's metrics.jsonl (issue 36 item 3): so a user can budget a run.

    python -m lab.time_to_quality RUN_DIR [RUN_DIR ...] --taus 1.7 2.0 \\
        [--live STEP=TAU ...] [--live-from G_TAU_PER_K.json] [--offset-s S] --out runs/bench/time_to_quality.json

What it reads, per run directory (train/tracking.py), every row in the order written: the held-out evaluation
rows (``eval/tau_walk``: the τ a drafter gets walking the held-out blocks with the target's tokens, logged every
``eval_every`` steps and at the end) and each row's ``elapsed_s`` (seconds since the training process began, its
setup included; for `dflashkit train` its imports too, since 2026-12-05 late: before, the clock began when
``train`` was called, and the runs' 5-30 s of imports were not counted, lab/NOTEBOOK.md). A resumed run starts
``elapsed_s`` again from 0: the segments are added up (a row whose elapsed_s is below the one before starts a
new segment, counted from the previous segment's last row), so the time is the training processes' own, without
the pauses between them. ``--offset-s`` adds what came before training (e.g. the regeneration's wall time) to
every time.

What it writes: per run, the timeline (step, seconds, τ_walk), the first time τ_walk reached each of ``--taus``
(None when it never did), and the final τ_walk and its time. τ_walk is not live τ (held-out blocks with the
target's tokens, not a live decode; lab/NOTEBOOK.md: 2.76 held-out against 2.09 live at the end of the recipe), so
``--live STEP=TAU`` pairs (live τ measured on the checkpoint of STEP, from `dflashkit eval` or vLLM) calibrate it:
a least-squares line live = a · τ_walk + b over the pairs (one pair: the ratio, b = 0), and each threshold is also
given as the τ_walk that line maps onto it and the first time that was reached (``live_taus``). The calibration
is a model, said as one in the JSON; its pairs are listed with it. ``live_reached`` is the measurement itself: the
first measured checkpoint whose live τ reached each threshold, with its time (None when none did).
``--live-from`` reads the pairs of each run from bench/bench_vllm.py's ``g_tau_per_k.json`` instead (per run,
not one set for all): a drafter named ``<run>_step<N>`` is the checkpoint of step N of the run whose directory is
named ``<run>``, one named ``<run>`` is that run's export (the step its ``summary.json`` gives), each at the
largest k measured; a measured step without a held-out evaluation is listed under ``live_unpaired`` and left out.
Runs without ``elapsed_s`` (metrics written before it was logged) are refused in one line naming the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def timeline(rows: list[dict], source: str = "metrics.jsonl") -> list[dict]:
    """The held-out evaluations of one run in order: step, seconds (resumed segments added up), τ_walk."""
    out, base, last = [], 0.0, None
    for row in rows:
        if "elapsed_s" not in row:
            continue
        elapsed = float(row["elapsed_s"])
        if last is not None and elapsed < last:  # a resumed process: its clock started again
            base += last
        last = elapsed
        if row.get("eval/tau_walk") is not None:
            out.append({"step": int(row["step"]), "seconds": base + elapsed, "tau_walk": float(row["eval/tau_walk"])})
    if rows and last is None:
        raise SystemExit(f"{source}: no row has elapsed_s (written before dflashkit logged it): rerun the training "
                         "with this version, or time it from its log")
    return out


def first_time(points: list[dict], tau: float) -> dict | None:
    """The first evaluation whose τ_walk reached ``tau`` (None: none did)."""
    hit = next((p for p in points if p["tau_walk"] >= tau), None)
    return None if hit is None else {"step": hit["step"], "seconds": hit["seconds"]}


def calibration(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of live = a · τ_walk + b by least squares over (τ_walk, live) pairs; one pair (or equal τ_walks):
    the ratio of the means, b = 0."""
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if len(pairs) < 2 or sxx == 0:
        return my / mx, 0.0
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return a, my - a * mx


def summarise(rows: list[dict], taus: list[float], live: dict[int, float], offset_s: float = 0.0,
              source: str = "metrics.jsonl") -> dict:
    points = [{**p, "seconds": p["seconds"] + offset_s} for p in timeline(rows, source)]
    out = {"timeline": points, "taus": {str(t): first_time(points, t) for t in taus},
           "final": points[-1] if points else None, "offset_s": offset_s}
    if live:
        walk = {p["step"]: p["tau_walk"] for p in points}
        missing = sorted(set(live) - set(walk))
        if missing:
            raise SystemExit(f"{source}: --live steps {missing} have no held-out evaluation (evaluated steps: "
                             f"{sorted(walk)}); give the steps of evaluated checkpoints")
        pairs = [(walk[s], live[s]) for s in sorted(live)]
        a, b = calibration(pairs)
        listed = [{"step": s, "tau_walk": w, "live": v} for s, (w, v) in zip(sorted(live), pairs)]
        out["calibration"] = {"model": "live = a * tau_walk + b (least squares over the pairs)", "a": a, "b": b,
                              "pairs": listed}
        out["live_taus"] = {str(t): {"tau_walk": (t - b) / a, "reached": first_time(points, (t - b) / a)}
                            for t in taus} if a > 0 else {
            "skipped": f"live tau does not rise with tau_walk over these pairs (a = {a:.3g}): no threshold maps"}
        seconds = {p["step"]: p["seconds"] for p in points}
        out["live_reached"] = {str(t): next(({"step": s, "seconds": seconds[s], "live": live[s]}
                                             for s in sorted(live) if live[s] >= t), None) for t in taus}
    return out


def live_from_vllm(results: dict, run_dir: Path) -> dict[int, float]:
    """The live τ of one run's checkpoints and export from bench_vllm.py's g_tau_per_k.json (``--live-from``)."""
    name = run_dir.name
    best: dict[str, dict] = {}  # drafter name -> its row at the largest k
    for row in results.get("rows", []):
        if row.get("tau") is not None and (row["drafter"] not in best or row["k"] > best[row["drafter"]]["k"]):
            best[row["drafter"]] = row
    live = {}
    for drafter, row in best.items():
        if drafter == name:
            summary = run_dir / "summary.json"
            step = json.loads(summary.read_text()).get("step") if summary.is_file() else None
            if step is None:
                continue  # an export whose step is not known pairs with nothing
        elif drafter.startswith(name + "_step") and drafter[len(name) + 5:].isdigit():
            step = drafter[len(name) + 5:]
        else:
            continue
        live[int(step)] = float(row["tau"])
    return live


def parse_live(items: list[str]) -> dict[int, float]:
    live = {}
    for item in items or []:
        step, sep, tau = item.partition("=")
        if not sep or not step.strip().isdigit():
            raise SystemExit(f"--live {item}: give STEP=TAU, e.g. 2723=2.09")
        live[int(step)] = float(tau)
    return live


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="training output directories (each with metrics.jsonl)")
    p.add_argument("--taus", type=float, nargs="+", default=[1.7, 2.0])
    p.add_argument("--live", nargs="+", default=[], metavar="STEP=TAU", help="live τ at evaluated checkpoints")
    p.add_argument("--live-from", default=None, metavar="G_TAU_PER_K.json",
                   help="each run's live τ from bench_vllm.py's results (<run>_step<N> and <run>), instead of --live")
    p.add_argument("--offset-s", type=float, default=0.0, help="seconds before training (e.g. regeneration)")
    p.add_argument("--out", default=None, help="the JSON (default: print it)")
    args = p.parse_args(argv)
    if args.live and args.live_from:
        raise SystemExit("give --live or --live-from, not both")
    live = parse_live(args.live)
    vllm = None
    if args.live_from:
        try:
            vllm = json.loads(Path(args.live_from).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--live-from {args.live_from}: not a readable JSON file ({e})") from None
    result = {}
    for run in args.runs:
        source = Path(run) / "metrics.jsonl"
        if not source.is_file():
            raise SystemExit(f"{source}: not found: give a training output directory")
        text = source.read_text()  # every row in the order written (a resumed run's too); a cut last row skipped
        rows = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
        unpaired = {}
        if vllm is not None:
            live = live_from_vllm(vllm, Path(run))
            evaluated = {p["step"] for p in timeline(rows, str(source))}
            unpaired = {str(s): t for s, t in live.items() if s not in evaluated}
            live = {s: t for s, t in live.items() if s in evaluated}
        result[run] = summarise(rows, args.taus, live, args.offset_s, str(source))
        if unpaired:
            result[run]["live_unpaired"] = unpaired
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text if not args.out else f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
