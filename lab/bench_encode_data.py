"""The online run's data step at start-up (train/online.encode_data: render each record with the chat template,
tokenize, check the supervised spans), records tokenized together as the trainer does against one record per
tokenizer call, the form before 2026-12-05; inline and with tokenize workers.

Design choices:
- The data are a chat JSONL with answers (``--data``; on a GPU host the regenerated first turns of the testbed,
  e.g. /root/run/ttq/regen.jsonl), or stand-ins built from a file of user turns (``--questions``: the testbed
  ShareGPT, whose answers are not shipped): each first user turn answered by itself twice over, so the answers'
  length follows the questions'. Stand-ins say how fast the code is, not how long the real data take.
- ``per_record`` swaps extract/data/batching.py's chunk encoder for one that calls ``encode_records`` once per
  record, in the workers too (they are handed the encoder). Each form runs ``--repeats`` times
  in turn, no token cache, median wall time; the samples of the two forms are checked equal.

    python -m lab.bench_encode_data --questions .cache/gpud2/sharegpt.jsonl.gz --limit 10000 --workers 0 2 \
        --out runs/bench/encode_data_cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import write_json
from dflashkit.extract.data import batching
from dflashkit.extract.data.chat import encode_records
from dflashkit.extract.data.rendering import BadSample

FORMS = ("together", "per_record")


def _one_by_one(items):
    """batching._encode_items with one encode_records call (so one tokenizer call) per record."""
    tok, cfg, specials = (batching._WORKER[k] for k in ("tokenizer", "cfg", "specials"))
    samples, bad = [], []
    for item in items:
        s = BadSample(*item.bad) if item.bad is not None else encode_records([item.record], tok, cfg, specials)[0]
        if isinstance(s, BadSample):
            bad.append((s.reason, s.detail, item.where))
        else:
            samples.append(batching.Sample(item.index, item.where, s.input_ids, s.loss_mask, s.truncated,
                                           s.dropped_leading_turns))
    return samples, bad


_TOGETHER = batching._encode_items


def _set_form(form: str) -> None:
    """The chunk encoder encoded_windows calls inline or submits to its workers (by reference: a worker runs this
    module's function on its own batching._WORKER)."""
    batching._encode_items = _one_by_one if form == "per_record" else _TOGETHER


def stand_ins(questions: str, limit: int, out: Path) -> int:
    """A chat JSONL of each record's first user turn answered by itself twice over (module docstring)."""
    opener = gzip.open if questions.endswith(".gz") else open
    n = 0
    with opener(questions, "rt", encoding="utf-8") as f, out.open("w", encoding="utf-8") as w:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            first = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
            if not first:
                continue
            w.write(json.dumps({"messages": [{"role": "user", "content": first},
                                             {"role": "assistant", "content": f"{first} {first}"}]}) + "\n")
            n += 1
            if n >= limit:
                break
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a chat JSONL with answers")
    src.add_argument("--questions", help="ShareGPT JSONL(.gz) of user turns: stand-in answers (module docstring)")
    ap.add_argument("--limit", type=int, default=10000, help="--questions: this many records")
    ap.add_argument("--target", default="testbed:smollm2", help="whose tokenizer and chat template")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--workers", type=int, nargs="+", default=[0], help="tokenize workers (0: inline)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    forms = args.forms.split(",")
    if any(f not in FORMS for f in forms):
        ap.error(f"--forms: a comma list of {', '.join(FORMS)}")
    from transformers import AutoTokenizer

    from dflashkit.targets.loading import resolve_target_dir
    from dflashkit.train.online import encode_data

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target_dir(args.target)[0]))
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = str(Path(tmp) / "stand_ins.jsonl")
            stand_ins(args.questions, args.limit, Path(data))
        runs: dict[str, dict] = {}
        reference = None
        try:
            for workers in args.workers:
                for _ in range(args.repeats):
                    for form in forms:  # in turn, so a drift of the machine falls on both
                        _set_form(form)
                        start = time.perf_counter()
                        samples = encode_data([data], tokenizer, max_length=args.max_length, chat_template=None,
                                              template_kwargs={}, limit=None, tokenize_workers=workers,
                                              say=lambda _: None)
                        seconds = time.perf_counter() - start
                        got = [(s.index, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]
                        if reference is None:
                            reference = got
                        elif got != reference:
                            raise SystemExit(f"{form} with {workers} worker(s) gave other samples than the first run")
                        run = runs.setdefault(f"{form}_w{workers}", {"form": form, "workers": workers, "seconds": []})
                        run["seconds"].append(seconds)
                        print(f"{form:10s} workers {workers}: {seconds:.2f} s", flush=True)
        finally:
            _set_form("together")
    tokens = sum(len(ids) for _, ids, _ in reference)
    for run in runs.values():
        run["median_s"] = statistics.median(run["seconds"])
        run["tokens_per_s"] = tokens / run["median_s"]
    for workers in args.workers:
        a, b = runs.get(f"together_w{workers}"), runs.get(f"per_record_w{workers}")
        if a and b:
            a["speedup_vs_per_record"] = b["median_s"] / a["median_s"]
    result = {"data": args.data or f"stand-ins of {args.questions} (first {args.limit})", "target": args.target,
              "samples": len(reference), "tokens": tokens, "cores": len(os.sched_getaffinity(0)), "runs": runs}
    write_json(args.out, result)
    print(json.dumps({k: round(v["median_s"], 2) for k, v in runs.items()}))
    return result


if __name__ == "__main__":
    main()
