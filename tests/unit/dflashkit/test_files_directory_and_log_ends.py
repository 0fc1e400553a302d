"""dflashkit/files.py's helpers for the ends of two shapes: ``rename_dir_into_place`` (a directory written beside
its final name, made durable whole, renamed, the rename made durable) and ``whole_lines`` (an append log's lines
up to a cut last line, which it also cuts off the file)."""

from dflashkit.files import rename_dir_into_place, whole_lines

from support.fsyncs import record_fsyncs


def test_a_directory_is_fsynced_whole_then_renamed_and_its_parent_fsynced(tmp_path, monkeypatch):
    tmp = tmp_path / ".cache.tmp-1"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"weights")
    (tmp / "sub" / "tokenizer.json").write_text("{}")
    log = record_fsyncs(monkeypatch)
    rename_dir_into_place(tmp, tmp_path / "cache")
    assert not tmp.exists() and (tmp_path / "cache" / "sub" / "tokenizer.json").read_text() == "{}"
    root = tmp_path.resolve()
    assert {"model.safetensors", "tokenizer.json"} <= log.names()
    assert log.paths[-2:] == [root / ".cache.tmp-1", root]  # the directory before the rename, its parent after


def test_whole_lines_cuts_a_cut_last_line_off_the_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    assert whole_lines(log) == b"" and not log.exists()
    log.write_bytes(b'{"step": 1}\n{"step": 2}\n{"st')
    assert whole_lines(log) == b'{"step": 1}\n{"step": 2}\n'
    assert log.read_bytes() == b'{"step": 1}\n{"step": 2}\n'  # the next line appended starts a line of its own
    assert whole_lines(log) == b'{"step": 1}\n{"step": 2}\n'  # whole lines are left as they are
