"""Odd inputs to the chat-data readers and the commands built on them (issue 71): an input that can be read once
(a FIFO, standard input) is refused before it is opened; an input given twice under any spelling is refused; a
huge record is skipped by size without being held whole; a run whose every record was skipped exits 2 naming
the reasons; a resumed extraction on other data is refused naming the input that differs."""

import io
import json
import os
import threading

import pytest

from dflashkit.cli import run_main
from dflashkit.errors import UserError
from dflashkit.extract.__main__ import main as extract_main
from dflashkit.extract.data import sources
from dflashkit.extract.data.sources import iter_records
from dflashkit.extract.regenerate import main as regenerate_main

from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def extract(argv):
    return run_main("dflashkit extract", extract_main, argv)


def regenerate(argv):
    return run_main("dflashkit regenerate", regenerate_main, argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


# --------------------------------------------------------------------------- inputs that can be read once
def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    """The readers opened --data once for a first look and again for the records: a FIFO's writer was gone by then
    and the second open waited forever. A writer thread stands by here; the old code took its one empty pass for
    an empty file, and the refusal now comes without the FIFO ever being opened."""
    fifo = tmp_path / "chats.jsonl"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)  # returns once a reader opens
    writer.start()
    try:
        with pytest.raises(UserError, match=r"FIFO \(named pipe\), which can be read only once.*save it to a file"):
            list(iter_records([str(fifo)]))
        assert writer.is_alive()  # nobody opened the FIFO for reading (the writer's open returns only then)
    finally:
        while writer.is_alive():  # a reader's open lets the writer's open return (once the thread has reached it)
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            writer.join(0.05)


def test_standard_input_is_refused_with_the_reason(tmp_path):
    with pytest.raises(UserError, match=r"data '-' is standard input, which can be read only once"):
        list(iter_records(["-"]))


# --------------------------------------------------------------------------- an input given twice
def test_an_input_given_twice_under_any_spelling_is_refused(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    (tmp_path / "link.jsonl").symlink_to(data)
    monkeypatch.chdir(tmp_path)
    for twice in ([data, data], [data, "./d.jsonl"], [data, "link.jsonl"], [str(tmp_path), data]):
        with pytest.raises(UserError, match="given again.*read twice: give each input once"):
            list(iter_records(twice))
    with pytest.raises(UserError, match="given again"):
        list(iter_records(["builtin:mtbench", "builtin:mtbench"]))
    other = write_jsonl(tmp_path / "e.jsonl", chat_records(2, seed=1))
    assert len(list(iter_records([data, other]))) == 4  # two different files are two inputs


def test_extract_refuses_a_repeated_data_before_loading_the_target(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "out"
    assert extract(["--target", str(tmp_path / "no-target"), "--data", data, "--data", data, "--out", str(out),
                    "--no-progress"]) == 2
    assert "given again" in capsys.readouterr().err and not (out / "manifest.json").exists()


# --------------------------------------------------------------------------- a huge record
class ReadSizes(io.BytesIO):
    """A file that records the largest piece any read returned."""

    largest = 0

    def readline(self, size=-1):
        line = super().readline(size)
        self.largest = max(self.largest, len(line))
        return line


def test_a_record_over_the_cap_is_skipped_without_being_held_whole(monkeypatch):
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1000)
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (3 << 20)}]}).encode()
    good = json.dumps({"text": "a short record"}).encode()
    f = ReadSizes(good + b"\n" + huge + b"\n" + good + b"\n")
    lines = list(sources._capped_lines(f, 1000))
    assert [size for _, size in lines] == [len(good) + 1, len(huge) + 1, len(good) + 1]
    assert lines[1][0] is None and lines[0][0] == lines[2][0] == good + b"\n"
    assert f.largest <= 1 << 20  # the 3 MiB line was read in pieces, never whole


def test_huge_records_are_counted_as_too_large_in_every_format(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 4000)
    records = chat_records(3)
    records[1]["messages"][0]["content"] = "y" * 9000
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    array = tmp_path / "d.json"
    array.write_text(json.dumps(records))
    for path in (jsonl, array):
        items = list(iter_records([str(path)]))
        assert [it.bad[0] if it.bad else None for it in items] == [None, "too_large", None], path
        assert "over the 4000 bytes a record may hold" in items[1].bad[1]


def test_extract_counts_a_huge_record_and_keeps_the_rest(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 4000)
    records = chat_records(3)
    records[2]["messages"][0]["content"] = "z" * 9000
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    assert extract(["--target", tiny, "--data", data, "--out", str(out), "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"]["too_large"] == 1 and manifest["totals"]["samples"] == 2


# --------------------------------------------------------------------------- nothing usable is not a success
def test_extract_with_every_record_skipped_exits_2_naming_the_reasons(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [broken\n' + json.dumps({"rows": 1}) + "\n" + json.dumps({"rows": 2}) + "\n")
    assert extract(["--target", tiny, "--data", str(data), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "every record was skipped (malformed_json 1, unknown_format 2)" in err and "holds no sample" in err


def test_regenerate_with_every_conversation_skipped_exits_2(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [broken\n' + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert regenerate(["--target", tiny, "--data", str(data), "--out", str(out), "--max-new-tokens", "2",
                       "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "every conversation was skipped (malformed_json 1, unknown_role 1)" in err


# --------------------------------------------------------------------------- resume on other data
def test_extract_resume_on_other_data_is_refused_naming_the_input(tiny, tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(3))
    out = tmp_path / "out"
    assert extract(["--target", tiny, "--data", data, "--out", str(out), "--no-progress"]) == 0
    write_jsonl(tmp_path / "d.jsonl", chat_records(3, seed=5))  # same name, other records
    assert extract(["--target", tiny, "--data", data, "--out", str(out), "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{out} was extracted from other data: input 1 was {data}" in err and "resume with the original" in err
    write_jsonl(tmp_path / "d.jsonl", chat_records(3))  # the original bytes, spelled another way: resumes
    monkeypatch.chdir(tmp_path)
    assert extract(["--target", tiny, "--data", "./d.jsonl", "--out", str(out), "--no-progress", "--resume"]) == 0


def test_regenerate_resume_on_other_data_is_refused_naming_the_input(tiny, tmp_path, capsys, monkeypatch):
    """regenerate kept no record of its data, so --resume on other records appended their answers silently."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "regen.jsonl"
    argv = ["--target", tiny, "--out", str(out), "--max-new-tokens", "2", "--no-progress", "--device", "cpu"]
    assert regenerate([*argv, "--data", data]) == 0
    before = out.read_bytes()
    write_jsonl(tmp_path / "d.jsonl", chat_records(3, seed=5))  # same name, other records
    assert regenerate([*argv, "--data", data, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{out} was regenerated from other data: input 1 was {data}" in err and "--overwrite" in err
    assert out.read_bytes() == before  # nothing appended
    write_jsonl(tmp_path / "d.jsonl", chat_records(2))  # the original bytes, spelled another way: resumes
    monkeypatch.chdir(tmp_path)
    assert regenerate([*argv, "--data", "./d.jsonl", "--resume"]) == 0
    assert out.read_bytes() == before  # every conversation was done
    write_jsonl(tmp_path / "d.jsonl", chat_records(3, seed=5))
    assert regenerate([*argv, "--data", data, "--overwrite"]) == 0  # the other fix: start afresh
    assert len(out.read_text().splitlines()) == 3


def test_regenerate_output_without_a_data_record_resumes_with_a_note(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "regen.jsonl"
    argv = ["--target", tiny, "--out", str(out), "--max-new-tokens", "2", "--no-progress", "--device", "cpu",
            "--data", data]
    assert regenerate([*argv, "--limit", "1"]) == 0
    (tmp_path / "regen.jsonl.data.json").unlink()  # an output of before the record
    assert regenerate([*argv, "--resume"]) == 0
    assert "the data was not checked" in capsys.readouterr().out
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
    assert (tmp_path / "regen.jsonl.data.json").is_file()  # recorded now: the next resume is checked


# --------------------------------------------------------------------------- huge keys and values quoted cut
HUGE = "k" * 100_000


@pytest.mark.parametrize("record", [
    {HUGE: 1},  # an unknown format: its field names are listed
    {"messages": [{"role": HUGE, "content": "hi"}, {"role": "assistant", "content": "yo"}]},  # unknown role
], ids=["key", "role"])
def test_a_100_kb_key_or_role_in_a_record_is_cut_in_the_error(tiny, tmp_path, capsys, record):
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    assert extract(["--target", tiny, "--data", data, "--out", str(tmp_path / "out"), "--no-progress",
                    "--on-bad", "fail"]) == 2
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert "kkkk" in line and "(100000 characters)" in line and len(line) < 1000


def test_a_100_kb_data_spec_is_cut_in_the_error(tmp_path):
    with pytest.raises(UserError) as err:
        list(iter_records(["/nowhere/" + HUGE]))
    assert "(100009 characters)" in str(err.value) and "File name too long" in str(err.value)
    assert len(str(err.value)) < 1000


def test_a_data_directory_without_data_files_says_what_to_give(tiny, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not data")
    assert extract(["--target", tiny, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                    "--no-progress"]) == 2
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert f"{tmp_path / 'data'}: no .jsonl/.json/.parquet/.jsonl.gz files" in line and "give --data a file" in line
