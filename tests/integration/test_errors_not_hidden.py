"""Errors never hide bugs (dflashkit/errors.py): only a ``UserError`` is one line on stderr and exit status 2. A
plain ``ValueError`` (what Python raises for "too many values to unpack" or a shape mismatch) or a
``FileNotFoundError`` of a path the program made itself, raised inside `train`, `extract` or `eval` after their
input checks, leaves ``dflashkit.cli.main`` with its traceback, which the interpreter reports with exit status 1.

Each command runs in-process on a tiny CPU target; the error is injected at the first pass of the model that
command runs (the drafter for train and eval, a target MLP for extract), so it comes from inside the work."""

import functools
import subprocess
import sys
import traceback

import pytest
import transformers as tf

from dflashkit.cli import main as cli
from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.drafter.modeling_dflash import DFlashDraftModel
from dflashkit.errors import UserError

from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.paths import ROOT
from support.training import as_argv, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


def bug() -> ValueError:
    return ValueError("too many values to unpack (expected 2)")


def lost_file() -> FileNotFoundError:  # a path the program made, not one the user gave
    return FileNotFoundError(2, "No such file or directory", "/tmp/dflashkit-run/checkpoints/step-2/rng-rank0.json")


# a fresh exception per test: one raised before would carry the frames of that test's traceback
FAILURES = pytest.mark.parametrize("make_error", [bug, lost_file], ids=["ValueError", "FileNotFoundError"])


def injected_failure(error: BaseException, *args, **kwargs):
    raise error


def raising(error: BaseException):
    """A stand-in for a model's ``forward`` that raises ``error`` (``injected_failure`` in the traceback)."""
    return functools.partial(injected_failure, error)


def assert_propagates(argv: list[str], error: BaseException, capsys) -> None:
    with pytest.raises(type(error)) as raised:
        cli(argv)
    assert raised.value is error  # not replaced by a one-line message
    frames = "".join(traceback.format_tb(raised.value.__traceback__))
    assert "injected_failure" in frames and "run_main" in frames, frames[-2000:]
    assert ": error: " not in capsys.readouterr().err


def assert_one_line(argv: list[str], prog: str, capsys) -> None:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[-1] == f"{prog}: error: --widgets: 3 is too many; pass at most 2", err


def user_error():
    return UserError("--widgets: 3 is too many; pass at most 2")


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """(tiny Llama with the testbed tokenizer, a random 1-layer drafter export for it, chat data)."""
    root = tmp_path_factory.mktemp("errors")
    target = save_tiny_chat_target(root / "target")
    config = DrafterConfig.for_target(tf.AutoConfig.from_pretrained(target), num_hidden_layers=1, block_size=4,
                                      mask_token_id=0)
    save_drafter(build_drafter(config), root / "drafter")
    return target, root / "drafter", write_jsonl(root / "chats.jsonl", chat_records(4))


# ----------------------------------------------------------------------------- train
def train_argv(tiny_run, out) -> list[str]:
    target, shards = tiny_run
    return ["train", *as_argv(tiny_overrides(shards, out, target=str(target)))]


@FAILURES
def test_a_failure_inside_training_keeps_its_traceback(tiny_run, tmp_path, monkeypatch, capsys, make_error):
    error = make_error()
    monkeypatch.setattr(DFlashDraftModel, "forward", raising(error))
    assert_propagates(train_argv(tiny_run, tmp_path / "run"), error, capsys)


def test_a_user_error_inside_training_is_still_one_line(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(DFlashDraftModel, "forward", raising(user_error()))
    assert_one_line(train_argv(tiny_run, tmp_path / "run"), "dflashkit train", capsys)


# ----------------------------------------------------------------------------- extract
def extract_argv(chat_pair, out) -> list[str]:
    target, _, data = chat_pair
    return ["extract", "--target", target, "--data", str(data), "--out", str(out), "--layer-ids", "1,3",
            "--dtype", "float32", "--no-progress"]


@FAILURES
def test_a_failure_inside_extraction_keeps_its_traceback(chat_pair, tmp_path, monkeypatch, capsys, make_error):
    error = make_error()
    monkeypatch.setattr(tf.models.llama.modeling_llama.LlamaMLP, "forward", raising(error))
    assert_propagates(extract_argv(chat_pair, tmp_path / "shards"), error, capsys)


def test_a_user_error_inside_extraction_is_still_one_line(chat_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tf.models.llama.modeling_llama.LlamaMLP, "forward", raising(user_error()))
    assert_one_line(extract_argv(chat_pair, tmp_path / "shards"), "dflashkit extract", capsys)


# ----------------------------------------------------------------------------- eval
def eval_argv(chat_pair, out) -> list[str]:
    target, drafter, _ = chat_pair
    return ["eval", "--target", target, "--drafter", str(drafter), "--dataset", "builtin:mtbench", "--num-prompts",
            "1", "--max-new-tokens", "4", "--no-stop", "--out", str(out)]


@FAILURES
def test_a_failure_inside_eval_keeps_its_traceback(chat_pair, tmp_path, monkeypatch, capsys, make_error):
    error = make_error()
    monkeypatch.setattr(DFlashDraftModel, "forward", raising(error))
    assert_propagates(eval_argv(chat_pair, tmp_path / "report"), error, capsys)


def test_a_user_error_inside_eval_is_still_one_line(chat_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(DFlashDraftModel, "forward", raising(user_error()))
    assert_one_line(eval_argv(chat_pair, tmp_path / "report"), "dflashkit eval", capsys)


# ----------------------------------------------------------------------------- the exit status
def test_the_command_exits_1_with_the_traceback():
    # the interpreter's own report of what run_main let through: `python -m dflashkit` as a user runs it
    script = ("import sys, dflashkit.train.__main__ as command\n"
              "from dflashkit.cli import main\n"
              "def main_with_a_bug(argv):\n"
              "    first, second = (1, 2, 3)\n"
              "command.main = main_with_a_bug\n"
              "sys.exit(main(['train']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and "ValueError: too many values to unpack" in proc.stderr
    assert "error:" not in proc.stderr.replace("ValueError:", "")
