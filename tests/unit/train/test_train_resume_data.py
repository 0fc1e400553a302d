"""A resume reads the data its checkpoint was trained on (issue 71): every checkpoint keeps a fingerprint of the
data (train/data_fingerprint.py) and a resume on other data, online or from shards, is refused in one line
naming what differs, unless the user asks (resume_other_data=true, said at start); the same data under another
path resumes. A block larger than the training sequence is refused when the config is read."""

import json
import shutil

import pytest

from dflashkit.cli import main as cli
from dflashkit.errors import UserError
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.chat_data import chat_records, write_jsonl
from support.shards import make_shards
from support.training import as_argv, online_overrides, tiny_overrides, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("dflashkit train: error: "), err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def two_step_run(tiny_run, tmp_path_factory):
    """A run of 2 steps on the tiny shards, its checkpoint at step 2; copy it."""
    _, shards = tiny_run
    out = tmp_path_factory.mktemp("two_steps") / "run"
    train(load_config(None, [], **tiny_overrides(shards, out, max_steps=2)))
    return out


def test_resume_on_other_shards_is_refused_and_the_same_shards_elsewhere_resume(two_step_run, tiny_run, tmp_path,
                                                                                 capsys):
    target, shards = tiny_run
    out = shutil.copytree(two_step_run, tmp_path / "run")
    other = make_shards(tmp_path / "other", target, seed=1)  # as many samples, other tokens
    capsys.readouterr()
    assert cli(["train", *as_argv(tiny_overrides(other, out, max_steps=4))]) == 2
    line = error_line(capsys)
    assert "step-00000002/trainer.json: the checkpoint was trained on other data: it was trained on shards of 12 " \
           "samples" in line and "this run reads shards of 12 samples" in line and "resume_other_data=true" in line
    assert sorted(train_losses(out)) == [1, 2]  # nothing of the refused run was logged
    moved = shutil.copytree(shards, tmp_path / "moved")  # the same shards under another path resume
    assert train(load_config(None, [], **tiny_overrides(moved, out, max_steps=4)))["step"] == 4


def test_resume_other_data_true_continues_and_says_so(two_step_run, tiny_run, tmp_path, capsys):
    target, _ = tiny_run
    out = shutil.copytree(two_step_run, tmp_path / "run")
    other = make_shards(tmp_path / "other", target, seed=1)
    summary = train(load_config(None, [], **tiny_overrides(other, out, max_steps=3, resume_other_data=True)))
    assert summary["step"] == 3
    assert "resume_other_data=true: resuming step-00000002 on other data (it was trained on shards" in \
        capsys.readouterr().out


def test_online_resume_on_changed_records_is_refused_naming_the_file(chat_run, tmp_path, capsys):
    target, _, _ = chat_run
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(10, seed=3))
    out = tmp_path / "run"
    train(load_config(None, [], **online_overrides(out, target=target, data=[data], max_steps=2)))
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer.json").read_text())
    assert state["data"]["kind"] == "online" and state["data"]["inputs"][0]["spec"] == data
    write_jsonl(tmp_path / "chats.jsonl", chat_records(10, seed=4))  # the same file name, other conversations
    capsys.readouterr()
    assert cli(["train", *as_argv(online_overrides(out, target=target, data=[data], max_steps=4))]) == 2
    line = error_line(capsys)
    assert f"the checkpoint was trained on other data: input 1 was {data} (" in line
    assert f"this run's is {data} (" in line and "resume with the data it was trained on" in line


def test_a_block_larger_than_the_sequence_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(UserError, match=r"block_size=16 is larger than max_length=8: a block must fit in a training "
                                        r"sequence; lower block_size or raise max_length to at least 16"):
        load_config(None, [], block_size=16, max_length=8)
    assert load_config(None, [], block_size=8, max_length=8).block_size == 8
