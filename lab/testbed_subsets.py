"""Training sets of several sizes from one regeneration of the testbed's ShareGPT conversations.

    python -m lab.testbed_subsets --regen RUN/regen.jsonl --out RUN/data --first 5000 11146

Reads the regenerated conversations (``dflashkit regenerate`` output, and the per-rank parts a stopped multi-GPU run
left beside it) and writes ``all.jsonl`` (every conversation, every answered turn) and ``firstN.jsonl`` (the first
user turn and the target's answer of the first N conversations, in index order). A conversation's first answer
does not depend on its later turns, so the subsets are exactly what a first-turn-only regeneration would give.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_rows(regen: Path) -> list[dict]:
    rows = {}
    for path in [regen, *sorted(regen.parent.glob(f"{regen.name}.rank*-of-*"))]:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill: its conversation is simply absent
                        continue
                    rows[row["index"]] = row
    return [rows[i] for i in sorted(rows)]


def first_exchange(row: dict) -> dict | None:
    msgs = row["messages"]
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            return {"index": row["index"], "messages": msgs[:k + 1]}
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regen", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first", type=int, nargs="*", default=[5000, 11146])
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(Path(args.regen))
    sizes = {}
    with open(out / "all.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"index": row["index"], "messages": row["messages"]}, ensure_ascii=False) + "\n")
    sizes["all"] = {"conversations": len(rows),
                    "answers": sum(m["role"] == "assistant" for r in rows for m in r["messages"])}
    firsts = [e for e in (first_exchange(r) for r in rows) if e is not None]
    for n in args.first:
        with open(out / f"first{n}.jsonl", "w", encoding="utf-8") as f:
            for e in firsts[:n]:
                f.write(json.dumps(e, ensure_ascii=False) + "\n")
        sizes[f"first{n}"] = {"conversations": min(n, len(firsts)), "answers": min(n, len(firsts))}
    print(json.dumps(sizes))


if __name__ == "__main__":
    main()
