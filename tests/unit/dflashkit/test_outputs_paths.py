"""Output paths (dflashkit/outputs.py): a command replaces an existing output only when it holds what the command
writes, else it stops in one line naming the path and the flag that forces it; a file in the way is never
replaced; exports, checkpoints and shards get the umask's modes."""

import json
import os
import stat

import pytest

from dflashkit.cli import main as cli

from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.paths import TINY_RECIPE
from support.shards import make_shards
from support.tiny_targets import make_tiny_target
from support.training import tiny_overrides


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target dir, shard dir, run dir) of a one-step training on the tiny target."""
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.trainer import train

    root = tmp_path_factory.mktemp("outputs")
    target = make_tiny_target(root / "target")
    shards = make_shards(root / "shards", target, num_samples=6)
    train(TrainConfig(**tiny_overrides(shards, root / "run", max_steps=1, eval_samples=1)))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return target, shards, root / "run"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def mine(path):
    """Files a user keeps in a directory: they must survive a refused command byte for byte."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "shard-000.safetensors").write_bytes(b"my data")
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_export_into_a_directory_of_other_files_refuses_and_keeps_them(trained, tmp_path, capsys):
    _, _, run = trained
    dst = tmp_path / "dst"
    before = mine(dst)
    assert cli(["export", str(run), str(dst)]) == 2
    err = one_line_error(capsys)
    assert str(dst) in err and "--overwrite" in err and "notes.txt" in err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert not any(p.name.startswith(".dst") for p in tmp_path.iterdir())  # no hidden copy left beside it


def test_overwrite_never_replaces_other_files_and_an_earlier_export_is_replaced_without_it(trained, tmp_path,
                                                                                            capsys):
    """--overwrite removes only what export wrote (issue 71): a directory of the user's files is kept."""
    _, _, run = trained
    dst = tmp_path / "dst"
    before = mine(dst)
    assert cli(["export", str(run), str(dst), "--overwrite"]) == 2
    err = one_line_error(capsys)
    assert str(dst) in err and "notes.txt" in err and "removes only what it wrote" in err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    dst = tmp_path / "export"
    assert cli(["export", str(run), str(dst)]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    first = (dst / "model.safetensors").stat().st_ino
    assert cli(["export", str(run), str(dst), "--dtype", "float32"]) == 0  # an export: replaced, no flag needed
    assert json.loads((dst / "config.json").read_text())["dtype"] == "float32"
    assert (dst / "model.safetensors").stat().st_ino != first


def test_a_file_at_the_export_path_is_an_error_and_survives(trained, tmp_path, capsys):
    _, _, run = trained
    dst = tmp_path / "drafter"
    dst.write_text("not a directory\n")
    for extra in ([], ["--overwrite"]):
        assert cli(["export", str(run), str(dst), *extra]) == 2
        err = one_line_error(capsys)
        assert str(dst) in err and "a file is in the way" in err
        assert dst.read_text() == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # nothing renamed away beside it


def test_init_drafter_refuses_a_directory_of_other_files(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target")
    dst = tmp_path / "d"
    before = mine(dst)
    capsys.readouterr()  # the model saver's progress bar
    argv = ["init-drafter", "--target", str(target), "--out", str(dst), "--recipe", str(TINY_RECIPE),
            "target_layer_ids=[0,2]"]
    assert cli(argv) == 2
    err = one_line_error(capsys)
    assert str(dst) in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert cli(argv + ["--overwrite"]) == 2  # --overwrite removes only what dflashkit wrote (issue 71)
    assert "removes only what it wrote" in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_train_refuses_foreign_output_and_export_dirs_before_training(trained, tmp_path, capsys):
    _, shards, _ = trained
    out = tmp_path / "run"
    before = mine(out)
    argv = ["train", "--recipe", str(TINY_RECIPE), f"shards={shards}", f"output_dir={out}", "max_steps=1",
            "wandb=false", "progress=false", "num_workers=0"]
    assert cli(argv) == 2
    err = one_line_error(capsys)
    assert str(out) in err and "overwrite=true" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing trained, nothing written
    export = tmp_path / "export"
    before_export = mine(export)
    run2 = tmp_path / "run2"
    assert cli(argv[:4] + [f"output_dir={run2}", f"export_dir={export}"] + argv[5:]) == 2
    err = one_line_error(capsys)
    assert str(export) in err and "overwrite=true" in err
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before_export
    assert not (run2 / "checkpoints").exists()
    # overwrite=true: the run may write beside the user's files, but never replaces a directory it did not write
    assert cli(argv[:4] + [f"output_dir={run2}", f"export_dir={export}", "overwrite=true"] + argv[5:]) == 2
    assert str(export) in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before_export
    assert cli(argv[:4] + [f"output_dir={out}", "overwrite=true"] + argv[5:]) == 0
    assert {name: (out / name).read_bytes() for name in before} == before  # the user's files, beside the run's
    assert (out / "export" / "model.safetensors").is_file()


def test_exports_checkpoints_and_shards_follow_the_umask(tmp_path):
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.trainer import train

    old = os.umask(0o027)  # not 022: a hard-coded 0644 / 0755 would pass that
    try:
        target = make_tiny_target(tmp_path / "target")
        shards = make_shards(tmp_path / "shards", target, num_samples=4)
        train(TrainConfig(**tiny_overrides(shards, tmp_path / "run", max_steps=1, eval_samples=1)))
    finally:
        os.umask(old)
    seen = {"file": 0, "dir": 0}
    for root in (shards, tmp_path / "run" / "export", tmp_path / "run" / "checkpoints"):
        for p in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(p.stat().st_mode)
            kind = "dir" if p.is_dir() else "file"
            assert mode == (0o750 if kind == "dir" else 0o640), f"{p}: {oct(mode)}"
            seen[kind] += 1
    assert seen["file"] >= 8 and seen["dir"] >= 3


def test_the_online_token_cache_follows_the_umask(tmp_path):
    """output_dir/token-cache/ of online training (safetensors' save_file alone writes 0600)."""
    from types import SimpleNamespace

    import numpy as np

    from dflashkit.train.online import read_token_cache, write_token_cache

    samples = [SimpleNamespace(input_ids=np.arange(5), loss_mask=np.ones(5, dtype=bool), index=i) for i in range(2)]
    old = os.umask(0o027)  # not 022: a hard-coded 0644 / 0755 would pass that
    try:
        write_token_cache(tmp_path / "cache" / "tokens.safetensors", samples, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "cache" / "tokens.safetensors").stat().st_mode) == 0o640
    samples_back, _ = read_token_cache(tmp_path / "cache" / "tokens.safetensors", say=pytest.fail)
    assert [s.input_ids.tolist() for s in samples_back] == [list(range(5))] * 2


# --------------------------------------------------------------------------- extract and regenerate
@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("chat") / "target")


def test_extract_refuses_foreign_files_even_with_overwrite_which_replaces_an_extraction(chat_target, tmp_path, capsys):
    from dflashkit.extract.shards.manifest import read_manifest

    data = write_jsonl(tmp_path / "d.jsonl", chat_records(3))
    out = tmp_path / "out"
    before = mine(out)
    argv = ["extract", "--target", chat_target, "--data", data, "--out", str(out), "--layer-ids", "0,2",
            "--no-progress"]
    assert cli(argv) == 2
    err = one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert cli(argv + ["--overwrite"]) == 2  # --overwrite removes only what extract wrote (issue 71)
    assert "removes only what it wrote" in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    out = tmp_path / "out2"
    argv[argv.index("--out") + 1] = str(out)
    assert cli(argv) == 0
    assert read_manifest(out)["totals"]["samples"] == 3
    capsys.readouterr()
    assert cli(argv) == 2  # an extraction: continued with --resume, replaced with --overwrite, never silently
    err = one_line_error(capsys)
    assert "--resume" in err and "--overwrite" in err
    assert cli(argv + ["--overwrite", "--layer-ids", "1"]) == 0
    assert read_manifest(out)["target_layer_ids"] == [1]


def test_regenerate_resume_refuses_a_file_it_did_not_write_and_keeps_it(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "chats.jsonl"
    out.write_text('{"messages": [{"role": "user", "content": "mine"}]}\n{"messages": []')  # no index; a cut line
    before = out.read_bytes()
    assert cli(["regenerate", "--target", "testbed:smollm2", "--data", data, "--out", str(out), "--resume",
                "--no-progress"]) == 2
    err = one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err
    assert out.read_bytes() == before  # not truncated, not appended to
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    assert cli(["regenerate", "--target", "testbed:smollm2", "--data", data, "--out", str(folder),
                "--no-progress"]) == 2
    assert "a directory is in the way" in one_line_error(capsys)


@pytest.mark.parametrize("command", ["extract", "regenerate"])
def test_resume_and_overwrite_are_one_rule_for_extract_and_regenerate(tmp_path, capsys, command):
    """Both flags together, and an output that holds something without either, stop in one line (one check,
    dflashkit/outputs.py: check_resume_flags), before a target is loaded."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / ("out" if command == "extract" else "out.jsonl")
    argv = [command, "--target", str(tmp_path / "no-target"), "--data", data, "--out", str(out), "--no-progress"]
    assert cli(argv + ["--resume", "--overwrite"]) == 2
    assert one_line_error(capsys).endswith("--resume continues what --out holds and --overwrite replaces it: pass "
                                           "one of them")
    if command == "extract":
        out.mkdir(exist_ok=True)  # the run above made it for its lock
        (out / "manifest.rank0.json").write_text("{}")
    else:
        out.write_text('{"index": 0, "messages": []}\n')
    assert cli(argv) == 2
    assert f"{out} already holds " in one_line_error(capsys)
