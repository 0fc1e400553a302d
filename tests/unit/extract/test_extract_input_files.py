"""Input files as users hand them over: a UTF-8 byte order mark (Windows editors write one) does not cost the first
record of a .jsonl, .jsonl.gz or .json file; `dflashkit verify` given a file that is no shard directory says what it
expects in one line instead of calling the user's file damaged."""

import codecs
import gzip
import json

import pytest

from dflashkit.cli import main as cli

from support.chat_data import chat_records, load_records

RECORDS = chat_records(3)


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.json"])
def test_a_byte_order_mark_keeps_the_first_record(tmp_path, name):
    body = (json.dumps(RECORDS) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in RECORDS))
    raw = codecs.BOM_UTF8 + body.encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    items = load_records(str(path))
    assert [it.bad for it in items] == [None] * 3
    assert [it.record for it in items] == RECORDS


def test_a_byte_order_mark_is_dropped_only_at_the_start(tmp_path):
    """Inside a record it is text like any other character (here, in a message)."""
    record = {"messages": [{"role": "user", "content": "\ufeffhi"}]}
    path = tmp_path / "d.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + (json.dumps(RECORDS[0]) + "\n" + json.dumps(record) + "\n").encode())
    assert [it.record for it in load_records(str(path))] == [RECORDS[0], record]


def verify_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert "Traceback" not in captured.err and len(lines) == 1, captured.err[-2000:]
    assert lines[0].startswith("dflashkit verify: error: ") and "damaged" not in lines[0]
    return lines[0]


def test_verify_given_a_data_file_says_what_it_expects(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    before = data.read_bytes()
    assert cli(["verify", str(data)]) == 2
    line = verify_line(capsys)
    assert f"{data}: a file, not a shard directory" in line and "dflashkit extract --out DIR" in line
    assert "manifest.json" in line and data.read_bytes() == before
    assert cli(["verify", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in verify_line(capsys)


def test_verify_takes_a_manifest_for_its_directory(tiny_run, capsys):
    _, shards = tiny_run
    assert cli(["verify", str(shards / "manifest.json")]) == 0
    assert f"verify: OK {shards}" in capsys.readouterr().out
