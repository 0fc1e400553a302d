"""dflashkit/files.py's helpers for the ends of two shapes: ``rename_dir_into_place`` (a directory written beside
its final name, made durable whole, renamed, the rename made durable), ``swap_dir_into_place`` (the same where
a previous directory is moved aside first: a checkpoint step written again, an export replaced) and
``whole_lines`` (an append log's lines up to a cut last line, which it also cuts off the file)."""

from dflashkit.files import rename_dir_into_place, swap_dir_into_place, whole_lines

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


def test_a_swap_moves_the_previous_directory_aside_whole_and_makes_the_new_one_durable(tmp_path, monkeypatch):
    previous, tmp, aside = tmp_path / "step-7", tmp_path / ".step-7.tmp", tmp_path / ".old-step-7"
    (previous / "sub").mkdir(parents=True)
    (previous / "sub" / "model.safetensors").write_bytes(b"old")
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "model.safetensors").write_bytes(b"new")
    aside.mkdir()
    log = record_fsyncs(monkeypatch)
    swap_dir_into_place(tmp, previous, aside)
    assert (previous / "sub" / "model.safetensors").read_bytes() == b"new" and not tmp.exists()
    assert (aside / "step-7" / "sub" / "model.safetensors").read_bytes() == b"old"  # whole, for the caller
    root = tmp_path.resolve()
    assert log.paths[0] == root / ".step-7.tmp" / "sub" / "model.safetensors"  # the new files first
    assert log.paths[-2:] == [root / ".step-7.tmp", root]  # the directory before the renames, its parent after
    # nothing at the path: the same as rename_dir_into_place, the aside left empty
    fresh = tmp_path / ".step-8.tmp"
    fresh.mkdir()
    (fresh / "checkpoint.json").write_text("{}")
    swap_dir_into_place(fresh, tmp_path / "step-8", aside)
    assert (tmp_path / "step-8" / "checkpoint.json").read_text() == "{}" and [p.name for p in aside.iterdir()] == [
        "step-7"]


def test_whole_lines_cuts_a_cut_last_line_off_the_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    assert whole_lines(log) == b"" and not log.exists()
    log.write_bytes(b'{"step": 1}\n{"step": 2}\n{"st')
    assert whole_lines(log) == b'{"step": 1}\n{"step": 2}\n'
    assert log.read_bytes() == b'{"step": 1}\n{"step": 2}\n'  # the next line appended starts a line of its own
    assert whole_lines(log) == b'{"step": 1}\n{"step": 2}\n'  # whole lines are left as they are
