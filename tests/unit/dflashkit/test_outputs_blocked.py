"""Output paths that cannot be written (dflashkit/outputs.py check_writable): a file where a directory of the path
should be, and a directory this user may not write, stop every writing command in one line naming the path and the
fix, before a target, a checkpoint or data is read (no OSError traceback from a mkdir or an open later on)."""

import os

import pytest

from dflashkit.cli import main as cli

from support.chat_data import chat_records, write_jsonl

NO_TARGET = "no-such-target-dir"  # a command that got as far as loading a target would fail on this name instead


def argv_writing(command: str, out, tmp_path) -> list[str]:
    """The command line of ``command`` with ``out`` as its output; every input it would read later is missing or
    empty, so only a check made before any work can answer about ``out``."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    return {
        "extract": ["extract", "--target", NO_TARGET, "--data", data, "--out", str(out), "--no-progress"],
        "regenerate": ["regenerate", "--target", NO_TARGET, "--data", data, "--out", f"{out}.jsonl",
                       "--no-progress"],
        "train": ["train", f"shards={tmp_path / 'shards'}", f"output_dir={out}", "wandb=false", "progress=false"],
        "export": ["export", str(tmp_path / "no-such-checkpoint"), str(out)],
        "init-drafter": ["init-drafter", "--target", NO_TARGET, "--out", str(out)],
        "eval": ["eval", "--target", NO_TARGET, "--drafter", str(tmp_path / "no-such-drafter"), "--out", str(out)],
    }[command]


COMMANDS = ["extract", "regenerate", "train", "export", "init-drafter", "eval"]


def error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"dflashkit {command}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_on_the_way_to_the_output_is_one_line(command, tmp_path, capsys):
    blocker = tmp_path / "notes"
    blocker.write_text("my notes\n")
    out = blocker / "runs" / "out"  # two levels under a file: mkdir(parents=True) would raise NotADirectoryError
    assert cli(argv_writing(command, out, tmp_path)) == 2
    line = error_line(capsys, command)
    assert f"{blocker} is a file" in line and "move it away or pick another path" in line
    assert NO_TARGET not in line and blocker.read_text() == "my notes\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory of any mode")
@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_this_user_cannot_write_is_one_line(command, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # readable, not writable: as a read-only file system or another user's directory
    try:
        assert cli(argv_writing(command, locked / "out", tmp_path)) == 2
        line = error_line(capsys, command)
        assert f"{locked} is not writable by this user (mode 500)" in line and f"make {locked} writable" in line
        assert NO_TARGET not in line and list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory of any mode")
def test_an_existing_output_directory_this_user_cannot_write_is_one_line(tmp_path, capsys):
    """The output directory itself exists but is not writable: the lock file could not go in (eval and extract
    take the lock first)."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o500)
    try:
        for command in ("eval", "extract"):
            assert cli(argv_writing(command, out, tmp_path)) == 2
            assert f"{out} is not writable by this user" in error_line(capsys, command)
    finally:
        out.chmod(0o700)


def test_check_writable_says_which_directory_blocks(tmp_path):
    from dflashkit.errors import UserError
    from dflashkit.outputs import check_writable

    check_writable(tmp_path / "new" / "deeper", "a report")  # nothing exists yet under a writable directory: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"/file is a file, so a report cannot be made there"):
        check_writable(tmp_path / "file" / "new" / "deeper", "a report")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory of any mode")
def test_a_temporary_sibling_in_a_directory_this_user_cannot_write_is_one_line(tmp_path):
    """Export writes its directory as a temporary sibling renamed into place (dflashkit/outputs.py make_temp_dir):
    an existing export in a directory this user cannot write stops there in one line."""
    from dflashkit.errors import UserError
    from dflashkit.outputs import make_temp_dir

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(UserError, match=rf"{locked}: cannot write a temporary directory there \(Permission"):
            make_temp_dir(locked, ".export.")
    finally:
        locked.chmod(0o700)
