"""Errors from the environment are one line on stderr and exit status 2, naming the path and the fix, and the fix
works: a loop of symbolic links on an output path, a cache directory that cannot be written, a target without a
tokenizer or whose config disagrees with its weights."""

import json
import os
import shutil

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
        "train": ["train", f"shards={tmp_path / 'shards'}", f"output_dir={out}", "wandb=false", "progress=false"],
        "export": ["export", str(tmp_path / "no-such-checkpoint"), str(out)],
        "init-drafter": ["init-drafter", "--target", NO_TARGET, "--out", str(out)],
        "eval": ["eval", "--target", NO_TARGET, "--drafter", str(tmp_path / "no-such-drafter"), "--out", str(out)],
    }[command]
    assert cli(argv) == 2
    line = error_line(command=command, capsys=capsys)
    assert f"{out}: a loop of symbolic links on the way" in line and NO_TARGET not in line
    assert os.readlink(loop) == str(loop)


# ----------------------------------------------------------------------------- a target that does not fit together
def test_a_target_without_a_tokenizer_is_one_line_and_saving_one_works(target, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(target, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "chat_template*"))
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "out.jsonl"
    assert cli(regenerate_argv(bare, data, out)) == 2
    line = error_line(capsys, "regenerate")
    assert f"{bare}: no tokenizer could be loaded (" in line and "tokenizer.save_pretrained(dir)" in line
    tokenizer = tiny_tokenizer()  # the advice, followed
    tokenizer.chat_template = PLAIN
    tokenizer.save_pretrained(bare)
    assert cli(regenerate_argv(bare, data, out)) == 0


@pytest.mark.parametrize("command", ["regenerate", "init-drafter"])
def test_a_config_whose_vocab_size_disagrees_with_the_weights_is_one_line(command, target, tmp_path, capsys):
    """The full target (regenerate, extract, online training, eval) and the head alone (init-drafter, training
    on shards) both read config.json against the embedding's shape before loading; the advice fixes it."""
    moved = tmp_path / "t"
    shutil.copytree(target, moved)
    config = json.loads((moved / "config.json").read_text())
    rows = config["vocab_size"]
    (moved / "config.json").write_text(json.dumps({**config, "vocab_size": rows + 8}))
    argv = {"regenerate": regenerate_argv(moved, write_jsonl(tmp_path / "d.jsonl", chat_records(2)),
                                          tmp_path / "out.jsonl"),
            "init-drafter": ["init-drafter", "--target", str(moved), "--out", str(tmp_path / "drafter")]}[command]
    assert cli(argv) == 2
    line = error_line(capsys, command)
    assert f"{moved / 'config.json'}: vocab_size {rows + 8}, hidden_size {config['hidden_size']}, but " \
           f"model.embed_tokens.weight in model.safetensors is [{rows}, {config['hidden_size']}]" in line
    assert f"set vocab_size to {rows}" in line
    (moved / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))  # the advice, followed
    assert cli(argv) == 0


# ----------------------------------------------------------------------------- caches that cannot be written
def test_a_gguf_cache_that_cannot_be_written_is_one_line_and_the_default_cache_works(tmp_path, capsys,
                                                                                     monkeypatch):
    """DFLASHKIT_CACHE (where a GGUF target is converted once) names a file: the conversion's directory cannot be
    made. The advice (a writable DFLASHKIT_CACHE, or unset: ~/.cache/dflashkit) loads the testbed."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("DFLASHKIT_CACHE", str(blocker))
    argv = ["init-drafter", "--target", "testbed:smollm2", "--mask-token-id", "0", "--out", str(tmp_path / "d")]
    assert cli(argv) == 2
    line = error_line(capsys, "init-drafter")
    assert f"{blocker}/testbed/smollm2: the converted target cannot be written there (" in line
    assert "set DFLASHKIT_CACHE to a writable directory" in line and blocker.read_text() == "not a directory\n"
    monkeypatch.delenv("DFLASHKIT_CACHE")  # the advice, followed (the default cache, converted by earlier tests)
    assert cli(argv) == 0


def test_a_token_cache_directory_that_cannot_be_written_leaves_a_note_and_training_goes_on(tmp_path, capsys):
    """The token cache under output_dir only saves a resumed run the tokenizing: a token-cache that cannot be
    written (here a file in its place; a read-only one alike) is a note, not a stop."""
    from support.training import as_argv, extract_chat_run, online_overrides

    target, data, _ = extract_chat_run(tmp_path / "chat")
    out = tmp_path / "run"
    out.mkdir()
    (out / "token-cache").write_text("in the way\n")
    assert cli(["train", *as_argv(online_overrides(out, target=target, data=[data], max_steps=1,
                                                   save_every=0))]) == 0
    said = capsys.readouterr().out
    assert f"note: token cache {out / 'token-cache'}/" in said and "training goes on without it" in said
    assert (out / "token-cache").read_text() == "in the way\n" and (out / "summary.json").is_file()


@pytest.mark.slow
def test_a_compile_cache_that_cannot_be_written_is_one_line_and_another_path_compiles(tmp_path, capsys,
                                                                                     monkeypatch):
    """compile=true writes inductor's cache (TORCHINDUCTOR_CACHE_DIR): a path under a file stops the run in one
    line before the first compile; a writable path, as the line says, trains compiled."""
    from support.shards import make_shards
    from support.tiny_targets import make_tiny_target
    from support.training import as_argv, tiny_overrides

    shards = make_shards(tmp_path / "shards", make_tiny_target(tmp_path / "target"))
    blocker = tmp_path / "notes"
    blocker.write_text("mine\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "inductor"))
    argv = ["train", *as_argv(tiny_overrides(shards, tmp_path / "run", epochs=1, compile=True, save_every=0))]
    capsys.readouterr()  # the progress of making the shards
    assert cli(argv) == 2
    line = error_line(capsys, "train")
    assert f"compile=true: {blocker / 'inductor'}: {blocker} is a file, so torch.compile's cache cannot be made" \
           in line and "TORCHINDUCTOR_CACHE_DIR sets the path" in line
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the advice, followed
    assert cli([*argv, "overwrite=true"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["compiled_graphs"]["compiled"] >= 1
