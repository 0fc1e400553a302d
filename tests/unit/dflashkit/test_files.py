"""The one durability guarantee of dflashkit/files.py in its shapes beyond ``atomic_write`` (tested with the
shards): a file a library writes to a path, a directory renamed into place, an append log. Each is checked by
what it fsyncs and in which order (the rename is durable only once the directory holding it is fsynced), and
by what a failure leaves."""

import os

import pytest

from dflashkit.files import atomic_write_with, fsync_tree, open_appending, sync

from support.fsyncs import record_fsyncs


def _fail_after_writing(path):
    path.write_text("half")
    raise OSError("disk full")


def test_a_file_a_library_writes_is_fsynced_renamed_and_its_directory_fsynced(tmp_path, monkeypatch):
    out = tmp_path / "cache.safetensors"
    out.write_text("old")
    log = record_fsyncs(monkeypatch)
    atomic_write_with(out, lambda path: path.write_text("new"))
    assert out.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["cache.safetensors"]
    temporary = tmp_path.resolve() / ".cache.safetensors.tmp"
    assert log.paths == [temporary, tmp_path.resolve()]  # the bytes before the rename, the rename after it


def test_a_failed_library_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "cache.safetensors"
    out.write_text("old")
    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(out, _fail_after_writing)
    assert out.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["cache.safetensors"]


def test_a_directory_is_fsynced_file_by_file_then_bottom_up(tmp_path, monkeypatch):
    tree = tmp_path / "step"
    (tree / "sub").mkdir(parents=True)
    for name in ("a.json", "sub/b.safetensors"):
        (tree / name).write_text(name)
    os.symlink(tree / "a.json", tree / "link")
    log = record_fsyncs(monkeypatch)
    fsync_tree(tree)
    root = tree.resolve()
    assert set(log.paths) == {root / "a.json", root / "sub" / "b.safetensors", root / "sub", root}
    assert log.paths.index(root / "sub" / "b.safetensors") < log.paths.index(root / "sub") < len(log.paths) - 1
    assert log.paths[-1] == root  # the directory last: everything in it is durable before it is renamed


def test_an_append_log_makes_its_new_name_durable_then_each_synced_batch(tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    log = record_fsyncs(monkeypatch)
    with open_appending(out) as f:
        assert log.paths == [tmp_path.resolve()]  # created: its name is durable before any line is written
        f.write('{"index": 0}\n')
        sync(f)
        assert log.paths[-1] == out.resolve()
    with open_appending(out) as f:  # continued (--resume): lines are added after the old ones
        f.write('{"index": 1}\n')
        sync(f)
    assert out.read_text() == '{"index": 0}\n{"index": 1}\n'
