"""lab/bench_encode_data.py on a few stand-in records: both forms run inline and in a worker, give the same
samples, and the per-record form calls the encoder once per record (the check that it runs, not a measurement)."""

import gzip
import json

from dflashkit.extract.data import batching
from lab import bench_encode_data as bed


def test_both_forms_encode_the_same_samples_inline_and_in_a_worker(tmp_path, monkeypatch):
    questions = tmp_path / "sharegpt.jsonl.gz"
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}: name {i} colours."}]} for i in range(7)]
    rows.insert(3, {"conversations": [{"from": "gpt", "value": "no user turn"}]})  # no stand-in made for it
    with gzip.open(questions, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    calls = []
    real = bed.encode_records

    def counted(records, *a, **k):  # inline runs only: a worker process has its own module
        calls.append(len(records))
        return real(records, *a, **k)

    monkeypatch.setattr(bed, "encode_records", counted)
    r = bed.main(["--questions", str(questions), "--limit", "5", "--workers", "0", "1", "--repeats", "1",
                  "--out", str(tmp_path / "e.json")])
    assert batching._encode_items is bed._TOGETHER  # the trainer's encoder is put back
    assert json.loads((tmp_path / "e.json").read_text()) == r
    assert r["samples"] == 5 and r["tokens"] > 5 * 20
    assert set(r["runs"]) == {"together_w0", "per_record_w0", "together_w1", "per_record_w1"}
    assert all(run["median_s"] > 0 and len(run["seconds"]) == 1 for run in r["runs"].values())
    assert calls == [1] * 5  # inline per_record: one call per record; the together form is batching's own
