"""Nothing of the user's is destroyed (issue 71): an output that is, lies inside or contains an input is refused
by every command before anything is touched, --overwrite included (dflashkit/outputs.py ``check_apart``); a
command never reads its own output back; an export names the step it actually read, however the run rotates its
checkpoints meanwhile (train/pinned_checkpoint.py)."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflashkit.cli import COMMANDS
from dflashkit.cli import main as cli

from support.chat_data import chat_records, write_jsonl
from support.paths import TINY_RECIPE
from support.shards import make_shards
from support.tiny_targets import make_tiny_target
from support.training import later_checkpoint, tiny_overrides

APART = "a command never writes where it reads, --overwrite or not"


def tree(path) -> dict:
    """Every file under ``path`` (or the file itself) by relative name, with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def refused(capsys, *paths) -> str:
    """The one error line, which names every path of ``paths`` and the rule."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert APART in err and all(str(p) in err for p in paths), err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with one complete checkpoint (step 1) of a tiny training."""
    from accelerate.state import AcceleratorState, GradientState

    from dflashkit.train.config import TrainConfig
    from dflashkit.train.trainer import train

    root = tmp_path_factory.mktemp("apart")
    target = make_tiny_target(root / "target")
    shards = make_shards(root / "shards", target, num_samples=6)
    train(TrainConfig(**tiny_overrides(shards, root / "run", max_steps=1, eval_samples=1)))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return root / "run", shards


def copy_run(run, tmp_path):
    """A copy of the module's run, for a test that may change it."""
    shutil.copytree(run[0], tmp_path / "run")
    return tmp_path / "run"


# --------------------------------------------------------------------------- the defects of issue 71
def test_regenerate_out_equal_to_its_data_is_refused_and_the_data_kept(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(3))
    before = tree(tmp_path)
    assert cli(["regenerate", "--target", str(tmp_path / "no-target"), "--data", data, "--out", data,
                "--overwrite", "--no-progress"]) == 2
    refused(capsys, data)
    assert tree(tmp_path) == before  # not deleted, no lock file beside it


def test_extract_out_holding_its_data_is_refused_and_the_folder_kept(tmp_path, capsys):
    folder = tmp_path / "D"
    folder.mkdir()
    data = write_jsonl(folder / "mine.jsonl", chat_records(3))
    (folder / "notes.txt").write_text("mine\n")
    before = tree(folder)
    argv = ["extract", "--target", str(tmp_path / "no-target"), "--data", data, "--out", str(folder),
            "--overwrite", "--no-progress"]
    assert cli(argv) == 2
    assert "contains the input --data" in refused(capsys, folder, data)
    assert tree(folder) == before
    link = tmp_path / "link"  # the same folder under another name: symbolic links are resolved
    link.symlink_to(folder)
    argv[argv.index("--out") + 1] = str(link)
    assert cli(argv) == 2
    assert f"{link} -> {folder}" in refused(capsys, link, data)
    assert tree(folder) == before


def test_export_over_the_runs_checkpoints_is_refused_and_every_checkpoint_kept(run, tmp_path, capsys):
    run = copy_run(run, tmp_path)
    before = tree(run)
    checkpoints = run / "checkpoints"
    assert cli(["export", str(run), str(checkpoints), "--overwrite"]) == 2
    refused(capsys, checkpoints)
    step = checkpoints / "step-00000001"
    assert cli(["export", str(step), str(step), "--overwrite"]) == 2  # a run's only checkpoint
    refused(capsys, step)
    assert cli(["export", str(step), str(checkpoints), "--overwrite"]) == 2
    assert "contains the input checkpoint" in refused(capsys, checkpoints, step)
    assert tree(run) == before
    assert cli(["export", str(run), str(run / "export")]) == 0  # beside the checkpoints, in the run: fine


def test_export_while_the_run_rotates_names_the_step_it_read(run, tmp_path, capsys, monkeypatch):
    import dflashkit.drafter as drafter

    run = copy_run(run, tmp_path)
    step1 = run / "checkpoints" / "step-00000001"
    read = load_file(step1 / "model.safetensors")
    save_drafter = drafter.save_drafter

    def rotated_meanwhile(*args, **kwargs):  # the training saves step 6 and rotates step 1 away mid-export
        later_checkpoint(run, 6)
        return save_drafter(*args, **kwargs)

    monkeypatch.setattr(drafter, "save_drafter", rotated_meanwhile)
    out = tmp_path / "drafter"
    assert cli(["export", str(run), str(out), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == f"exported step 1 ({step1}) -> {out}"
    assert not step1.exists() and (run / "checkpoints" / "step-00000006").is_dir()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["dflashkit_step"] == "1" and f.metadata()["dflashkit_checkpoint"] == str(step1)
        assert all(torch.equal(f.get_tensor(k), read[k]) for k in f.keys())  # step 1's weights, not step 6's


def test_a_pinned_checkpoint_is_read_whole_after_it_is_rotated_away(run, tmp_path):
    from dflashkit.train.pinned_checkpoint import pin_checkpoint

    run = copy_run(run, tmp_path)
    step1 = run / "checkpoints" / "step-00000001"
    read = load_file(step1 / "model.safetensors")
    with pin_checkpoint(run) as pinned:
        later_checkpoint(run, 6)
        assert not step1.exists()
        weights = pinned.weights()
        assert pinned.step == 1 and pinned.path == step1
        assert pinned.trainer_state()["step"] == 1
    assert set(weights) == set(read) and all(torch.equal(weights[k], read[k]) for k in read)


def test_a_changed_checkpoint_file_is_refused_not_exported(run, tmp_path, capsys):
    run = copy_run(run, tmp_path)
    weights = run / "checkpoints" / "step-00000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert cli(["export", str(run / "checkpoints" / "step-00000001"), str(tmp_path / "d")]) == 2
    assert "does not match its sha256" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_train_overwrite_deletes_only_what_a_run_wrote(run, tmp_path):
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.trainer import train

    copy = copy_run(run, tmp_path)
    (copy / "checkpoints" / "notes.txt").write_text("mine\n")
    (copy / "export" / "README.md").write_text("my drafter card\n")
    train(TrainConfig(**tiny_overrides(run[1], copy, max_steps=1, eval_samples=1, resume="none", overwrite=True,
                                       export_dir=str(tmp_path / "new-export"))))
    assert (copy / "checkpoints" / "notes.txt").read_text() == "mine\n"
    assert (copy / "export" / "README.md").read_text() == "my drafter card\n"
    assert (copy / "export" / "model.safetensors").is_file()  # not an export alone: kept whole, not half-deleted


def test_regenerate_never_reads_its_output_back_from_a_data_folder(tmp_path, capsys):
    folder = tmp_path / "D"
    folder.mkdir()
    write_jsonl(folder / "chats.jsonl", chat_records(3))
    before = tree(folder)
    out = folder / "out.jsonl"
    for extra in ([], ["--resume"]):
        assert cli(["regenerate", "--target", str(tmp_path / "no-target"), "--data", str(folder), "--out", str(out),
                    "--no-progress", *extra]) == 2
        assert "lies inside the input --data" in refused(capsys, out, folder)
    assert tree(folder) == before


def test_overwrite_of_a_file_regenerate_did_not_write_is_refused(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(2))
    out = tmp_path / "notes.jsonl"
    for text in ('{"title": "my notes"}\n', "one line of mine, no newline"):
        out.write_text(text)
        assert cli(["regenerate", "--target", str(tmp_path / "no-target"), "--data", data, "--out", str(out),
                    "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert str(out) in err and "only its own output" in err
        assert out.read_text() == text


def test_extract_overwrite_refuses_a_folder_whose_names_only_look_like_an_extraction(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(2))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text('{"title": "my manifest"}\n')  # the user's, named as extract names its own
    before = tree(out)
    assert cli(["extract", "--target", str(tmp_path / "no-target"), "--data", data, "--out", str(out), "--overwrite",
                "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "manifest.json is not a manifest dflashkit extract writes" in err and "removes only what it wrote" in err
    assert tree(out) == before


# --------------------------------------------------------------------------- every command applies the rule
def command_cases(tmp_path) -> dict:
    """For each command that writes, (argv whose output overlaps an input, the input, its relation)."""
    target = make_tiny_target(tmp_path / "target")
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "chats.jsonl", chat_records(2))
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "checkpoint.json").write_text("{}")
    return {
        "regenerate": (["--target", str(target), "--data", data, "--out", data, "--overwrite"], data),
        "extract": (["--target", str(target), "--data", data, "--out", str(tmp_path / "data"), "--overwrite"], data),
        "init-drafter": (["--target", str(target), "--out", str(target / "drafter"), "--recipe", str(TINY_RECIPE),
                          "--overwrite"], target),
        "train": (["--recipe", str(TINY_RECIPE), f"shards={tmp_path / 'data'}", f"output_dir={tmp_path}",
                   "overwrite=true"], tmp_path / "data"),
        "export": ([str(run), str(run / "checkpoints" / "step-00000001"), "--overwrite"], run / "checkpoints"),
        "eval": (["--target", str(target), "--drafter", str(target), "--out", str(target / "report"),
                  "--overwrite"], target),
        "demo": (["--run-dir", str(tmp_path / "data"), "--train-data", data, "--device", "cpu"], data),
    }


WRITES_NOTHING = {"verify"}  # reads a shard directory, writes nothing


def test_every_command_that_writes_refuses_an_output_over_its_input(tmp_path, capsys):
    cases = command_cases(tmp_path)
    capsys.readouterr()  # the model saver's progress bar
    assert set(cases) | WRITES_NOTHING == set(COMMANDS), "a new command: add its case here"
    for command, (argv, source) in cases.items():
        before = tree(tmp_path)
        assert cli([command, *argv]) == 2, command
        refused(capsys, source)
        assert tree(tmp_path) == before, command
