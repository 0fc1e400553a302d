"""Reading chat data: jsonl/json/parquet/saved datasets and the built-in testbed data; unreadable records are
yielded with their reason and file:line, everything else keeps a stable index."""

import gzip
import json

import pytest

from dflashkit.extract.data.sources import describe_sources, iter_records

from support.chat_data import load_records

REC = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
       for i in range(4)]


def test_jsonl_bad_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(REC[0]).encode(), b'{"messages": [oops', b"", json.dumps(REC[1]).encode(),
             b'{"text": "caf\xe9"}', json.dumps(REC[2]).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = load_records(str(path))
    assert [it.index for it in items] == [0, 1, 2, 3, 4]  # the blank line is not a record
    assert [it.bad[0] if it.bad else None for it in items] == [None, "malformed_json", None, "not_utf8", None]
    assert items[1].where == f"{path}:2" and items[3].where == f"{path}:5"
    assert items[4].record == REC[2]


def test_json_array_is_read_object_by_object(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(REC, indent=1))
    assert [it.record for it in load_records(str(good))] == REC
    cut = tmp_path / "cut.json"
    text = json.dumps(REC, indent=1)
    cut.write_text(text[: text.index('"a3"') + 2])  # cut inside the last object
    items = load_records(str(cut))
    assert [it.record for it in items[:3]] == REC[:3]
    assert items[3].bad[0] == "malformed_json" and items[3].where.startswith(f"{cut}:")
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": REC}))
    assert [it.record for it in load_records(str(wrapped))] == REC


def test_parquet_saved_dataset_directory_and_several_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(REC), tmp_path / "d.parquet")
    assert [it.record for it in load_records(str(tmp_path / "d.parquet"))] == REC
    datasets.Dataset.from_list(REC).save_to_disk(str(tmp_path / "saved"))
    assert [it.record for it in load_records(str(tmp_path / "saved"))] == REC
    datasets.DatasetDict({"test": datasets.Dataset.from_list(REC[:2])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="--split"):
        load_records(str(tmp_path / "dd"))
    assert len(load_records(str(tmp_path / "dd"), split="test")) == 2
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in REC))
    both = load_records([str(tmp_path / "d.parquet"), str(tmp_path / "e.jsonl.gz")])
    assert [it.index for it in both] == list(range(8)) and both[5].record == REC[1]


def test_builtin_testbed_data():
    counts = {name: sum(1 for _ in iter_records(name)) for name in
              ("builtin:sharegpt", "builtin:mtbench", "builtin:humaneval")}
    assert counts == {"builtin:sharegpt": 17671, "builtin:mtbench": 80, "builtin:humaneval": 164}
    first = load_records("builtin:sharegpt", limit=1)[0]
    assert first.record["conversations"][0]["from"] == "human"
    mt = load_records("builtin:mtbench", limit=1)[0].record
    assert [m["role"] for m in mt["messages"]] == ["user", "user"] and "Hawaii" in mt["messages"][0]["content"]
    he = load_records("builtin:humaneval", limit=1)[0].record
    assert he["id"] == "HumanEval/0" and "has_close_elements" in he["messages"][1]["content"]
    assert describe_sources(["builtin:mtbench"])[0]["bytes"] > 0


def test_unknown_sources_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="builtin:sharegpt"):
        load_records("builtin:nope")
    with pytest.raises(ValueError, match="not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data file type"):
        load_records(str(tmp_path / "x.csv"))
