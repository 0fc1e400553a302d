"""The advice an error gives works when followed, and what a command says of itself is true: an unfinished
extraction is finished by `extract --resume` (not by a keyword no command takes); shards with no sample are named
as such (not "lower eval_samples"); eval_samples too large names the bound; `verify` exits 2 for the wrong
argument and 1 for damage; the plan line does not claim a micro-batch bound a long sample breaks; a 100 KB key
is cut in the error that quotes it."""

import json

import pytest

from dflashkit.cli import main as cli

from support.chat_data import write_jsonl
from support.training import ONLINE_MAX_LENGTH, as_argv, extract_chat_run, online_overrides


def error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"dflashkit {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """(target, data, shards, the extract command that wrote the shards)."""
    target, data, shards = extract_chat_run(tmp_path_factory.mktemp("chat"))
    command = ["extract", "--target", target, "--data", data, "--out", str(shards), "--layer-ids", "1,3",
               "--max-length", str(ONLINE_MAX_LENGTH), "--dtype", "float32", "--bucket-window", "1",
               "--batch-tokens", "1", "--store-last-hidden", "--no-progress"]
    return target, data, shards, command


def train_argv(out, shards, **fields) -> list[str]:
    return ["train", *as_argv(online_overrides(out, shards=str(shards), max_steps=1, save_every=0, **fields))]


def test_an_unfinished_extraction_is_finished_by_the_advice(chat_run, tmp_path, capsys):
    _, _, shards, extract = chat_run
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))  # as a killed run leaves it
    capsys.readouterr()
    assert cli(train_argv(tmp_path / "run", shards)) == 2
    line = error_line(capsys, "train")
    assert f"{shards}: the extraction has not finished" in line and "allow_incomplete" not in line
    assert "run the `dflashkit extract` command that wrote it again, with --resume" in line
    assert cli([*extract, "--resume"]) == 0  # the advice, followed
    assert json.loads((shards / "manifest.json").read_text())["complete"]
    # micro_batch_tokens=10 is less than any sample: each gets a micro-batch of its own, longer than 10
    assert cli(train_argv(tmp_path / "run", shards, micro_batch_tokens=10)) == 0
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dflashkit train ("))
    longest = max(min(n, ONLINE_MAX_LENGTH) for n in _sample_lengths(shards))
    assert f"(<= 10 tokens each, a longer sample alone: up to {longest}) per step" in plan


def _sample_lengths(shards) -> list[int]:
    from dflashkit.extract.shards.reader import ShardDataset

    return [int(n) for n in ShardDataset(shards).lengths]


def test_shards_without_a_sample_are_named_and_eval_samples_names_its_bound(chat_run, tmp_path, capsys):
    target, _, shards, _ = chat_run
    long = [{"messages": [{"role": "user", "content": "tell " * 60}, {"role": "assistant", "content": "ok"}]}] * 3
    empty = tmp_path / "empty"
    assert cli(["extract", "--target", target, "--data", write_jsonl(tmp_path / "long.jsonl", long), "--out",
                str(empty), "--layer-ids", "1,3", "--max-length", "16", "--overlong", "drop", "--no-progress"]) == 2
    assert "error: extract: every record was skipped (too_long 3)" in capsys.readouterr().err  # its manifest stays
    assert cli(train_argv(tmp_path / "r0", empty)) == 2
    line = error_line(capsys, "train")
    assert f"{empty}: no sample to train on (0 samples" in line and "eval_samples" not in line
    samples = len(_sample_lengths(shards))
    assert cli(train_argv(tmp_path / "r1", shards, eval_samples=samples)) == 2
    line = error_line(capsys, "train")
    assert f"eval_samples={samples} leaves no training data ({samples} samples); set eval_samples below " \
           f"{samples}" in line
    assert cli(train_argv(tmp_path / "r1", shards, eval_samples=samples - 1)) == 0  # the advice, followed


def test_verify_exits_2_for_a_directory_that_is_no_shard_directory_and_1_for_damage(chat_run, tmp_path, capsys):
    _, _, shards, _ = chat_run
    assert cli(["verify", str(tmp_path)]) == 2  # an empty directory: the wrong argument
    line = error_line(capsys, "verify")
    assert f"{tmp_path}: a directory without manifest.json, not a shard directory" in line
    assert cli(["verify", str(shards)]) == 0  # the advice, followed: the directory extract wrote
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in shards.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    shard = next(damaged.glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert cli(["verify", str(damaged)]) == 1  # verify ran and found damage
    assert f"FAIL {shard}: size" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["override", "recipe", "drafter"])
def test_a_100_kb_key_is_cut_in_the_error(where, tmp_path, capsys):
    key = "k" * 100_000
    recipe = tmp_path / "recipe.yaml"  # explicit keys (?): YAML allows no plain key this long
    recipe.write_text(f"? {key}\n: 1\n" if where == "recipe" else f"drafter:\n  ? {key}\n  : 1\n")
    argv = ["train", f"shards={tmp_path}", f"{key}=1"] if where == "override" else \
        ["train", "--recipe", str(recipe), f"shards={tmp_path}"]
    assert cli(argv) == 2
    line = error_line(capsys, "train")
    assert "unknown field" in line and "kkkk... (100000 characters)" in line and len(line) < 1000


def test_a_run_without_a_checkpoint_and_a_checkpoint_given_as_a_drafter_say_what_to_do(chat_run, tmp_path, capsys):
    """`export` of a run that has saved nothing yet said only "neither a checkpoint nor a run directory"; `eval
    --drafter` on a training checkpoint asked for a config.json. Both now name the step that is missing."""
    target, data, shards, _ = chat_run
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # as a run looks before its first save
    capsys.readouterr()
    assert cli(["export", str(run), str(tmp_path / "export")]) == 2
    assert "the run has no complete checkpoint yet" in error_line(capsys, "export")
    assert cli(train_argv(run, shards)) == 0  # the first save: the export works
    assert cli(["export", str(run), str(tmp_path / "export")]) == 0
    step = next((run / "checkpoints").glob("step-*"))
    capsys.readouterr()
    assert cli(["eval", "--target", target, "--drafter", str(step), "--data", data, "--out",
                str(tmp_path / "eval"), "--device", "cpu"]) == 2
    line = error_line(capsys, "eval")
    assert f"{step} is a training checkpoint" in line and f"dflashkit export {step} DIR" in line


@pytest.mark.parametrize("where", ["recipe", "override"])
def test_a_misspelt_field_names_the_field_meant(where, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("block_sise: 4\n")
    argv = ["train", f"shards={tmp_path}", "block_sise=4"] if where == "override" else \
        ["train", "--recipe", str(recipe), f"shards={tmp_path}"]
    assert cli(argv) == 2
    assert "unknown field" in (line := error_line(capsys, "train")) and "(did you mean 'block_size'?)" in line


@pytest.mark.parametrize("text, said", [
    ("lr: 1e-3\nepochs: 2\nlr: 2e-3\n", "line 3: 'lr' is given again (line 1 gave it first)"),
    ("drafter:\n  intermediate_size: 64\n  intermediate_size: 32\n",
     "line 3: 'intermediate_size' is given again (line 2 gave it first)"),
], ids=["top", "drafter"])
def test_a_recipe_field_given_twice_is_refused_naming_both_lines(text, said, tmp_path, capsys):
    """YAML keeps the last of two equal keys: the first value never acted and the run said nothing."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert cli(["train", "--recipe", str(recipe), f"shards={tmp_path}"]) == 2
    assert f"{recipe}: {said}" in error_line(capsys, "train")
