"""Errors from the environment are one line on stderr and exit status 2, naming the path and the fix, and the fix
works: a loop of symbolic links on an output path, a cache directory that cannot be written, a target without a
tokenizer or whose config disagrees with its weights."""

import os

import pytest

from dflashkit.cli import main as cli

from support.chat_data import chat_records, write_jsonl
from support.chat_templates import PLAIN
from support.tiny_targets import save_tiny_target, tiny_tokenizer

NO_TARGET = "no-such-target-dir"  # a command that got as far as loading a target would fail on this name instead


def error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"dflashkit {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama with a tokenizer and a chat template."""
    path = save_tiny_target("llama", tmp_path_factory.mktemp("target") / "t")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = PLAIN
    tokenizer.save_pretrained(path)
    return path


def regenerate_argv(target, data, out) -> list[str]:
    return ["regenerate", "--target", str(target), "--data", data, "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "2", "--no-progress"]


# ----------------------------------------------------------------------------- a loop of symbolic links
def test_a_symlink_loop_as_regenerates_out_is_one_line_and_removing_it_works(target, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "out.jsonl"
    out.symlink_to(out)  # out -> out: opening it fails with ELOOP
    assert cli(regenerate_argv(target, data, out)) == 2
    line = error_line(capsys, "regenerate")
    assert f"{out}: a loop of symbolic links on the way; remove the link or pick another path" in line
    out.unlink()  # the advice, followed
    assert cli(regenerate_argv(target, data, out)) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("command", ["extract", "regenerate", "train", "export", "init-drafter", "eval"])
def test_a_symlink_loop_on_the_way_to_an_output_is_one_line(command, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    out = loop / "out"
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    argv = {
        "extract": ["extract", "--target", NO_TARGET, "--data", data, "--out", str(out), "--no-progress"],
        "regenerate": ["regenerate", "--target", NO_TARGET, "--data", data, "--out", str(out), "--no-progress"],
        "train": ["train", f"shards={tmp_path}", f"output_dir={out}", "wandb=false", "progress=false"],
        "export": ["export", str(tmp_path / "no-such-checkpoint"), str(out)],
        "init-drafter": ["init-drafter", "--target", NO_TARGET, "--out", str(out)],
        "eval": ["eval", "--target", NO_TARGET, "--drafter", str(tmp_path / "no-such-drafter"), "--out", str(out)],
    }[command]
    assert cli(argv) == 2
    line = error_line(command=command, capsys=capsys)
    assert f"{out}: a loop of symbolic links on the way" in line and NO_TARGET not in line
    assert os.readlink(loop) == str(loop)
