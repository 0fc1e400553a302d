"""Write the testbed's built-in datasets as plain JSONL files, for a machine that lacks the testbed packages.

    python -m lab.testbed_data --out .cache/gpu --sharegpt 8192 --split 2

Writes ``sharegpt.jsonl`` (the first N ShareGPT conversations that open with a user turn, cut to that turn:
``regenerate --max-turns 1`` reads nothing more), ``sharegpt_turns.jsonl`` (every conversation with a user turn, with
every user turn and no assistant text: ``regenerate`` answers each user turn in order and drops the original
answers anyway), ``mtbench.jsonl`` (80) and ``humaneval.jsonl`` (164), and with
``--split K`` also ``mtbench.partJ.jsonl`` / ``humaneval.partJ.jsonl`` (J < K, consecutive slices) so that
several ``dflashkit eval`` processes can share one GPU. Every file is read by ``--data`` / ``--dataset`` like
the built-in it came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflashkit.extract.data.sources import iter_records


def first_turn(record: dict) -> dict | None:
    turns = record.get("conversations") or []
    if not turns or str(turns[0].get("from", "")).lower() not in ("human", "user"):
        return None
    return {"id": record.get("id"), "conversations": turns[:1]}


def user_turns(record: dict) -> dict | None:
    turns = record.get("conversations") or []
    users = [t for t in turns if str(t.get("from", "")).lower() in ("human", "user") and t.get("value")]
    return {"id": record.get("id"), "conversations": users} if users else None


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    print(f"{path}: {len(records)} records, {path.stat().st_size / 1e6:.1f} MB")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sharegpt", type=int, default=8192, help="ShareGPT conversations to keep (0: all)")
    ap.add_argument("--split", type=int, default=1, help="also write the eval sets in K consecutive parts")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats, turns = [], []
    for item in iter_records("builtin:sharegpt"):
        if args.sharegpt and len(chats) >= args.sharegpt:
            break
        cut = first_turn(item.record) if item.record is not None else None
        if cut is not None:
            chats.append(cut)
        every = user_turns(item.record) if item.record is not None else None
        if every is not None:
            turns.append(every)
    write(out / "sharegpt.jsonl", chats)
    write(out / "sharegpt_turns.jsonl", turns)
    print(f"user turns: {sum(len(t['conversations']) for t in turns)}")
    for name in ("mtbench", "humaneval"):
        records = [item.record for item in iter_records(f"builtin:{name}") if item.record is not None]
        write(out / f"{name}.jsonl", records)
        if args.split > 1:
            size = -(-len(records) // args.split)
            for j in range(args.split):
                write(out / f"{name}.part{j}.jsonl", records[j * size:(j + 1) * size])


if __name__ == "__main__":
    main()
