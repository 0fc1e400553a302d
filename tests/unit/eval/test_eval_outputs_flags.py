"""`dflashkit eval` refuses what it cannot honour in one line, before the target loads: an --out that holds files
(yours, a drafter export, an earlier report) unless --overwrite, numeric flags out of range, a block size beyond
the drafter's, flags the chosen engine does not read, and `--compare` of a report.json that is not one."""

import json
import shutil

import pytest

from dflashkit.cli import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")

NO_TARGET = "no-such-target-dir"  # a run that got as far as loading a target would fail on this name instead


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("dflashkit eval: error: "), err[-2000:]
    return lines[0]


def eval_argv(root, out, *extra, target=None) -> list[str]:
    return ["eval", "--target", str(target or root / "target"), "--drafter", str(root / "drafter"), "--dataset",
            "builtin:mtbench", "--num-prompts", "1", "--max-new-tokens", "4", "--baseline-prompts", "0", "--no-stop",
            "--out", str(out), *extra]


def contents(path) -> dict:
    return {p.name: p.read_bytes() for p in path.iterdir()}


# ----------------------------------------------------------------------------- --out
def test_a_report_md_and_json_of_yours_are_not_replaced(chat_pair, tmp_path, capsys):
    root, _ = chat_pair
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.md").write_text("# my review notes\n")
    (out / "report.json").write_text('{"reviewer": "me"}\n')
    before = contents(out)
    assert cli(eval_argv(root, out)) == 2  # the real target: without the check this run writes its report here
    line = error_line(capsys)
    assert f"{out}: not a new report directory" in line and "report.json, report.md" in line
    assert "pick another path, or pass --overwrite" in line
    assert contents(out) == before


def test_a_drafter_export_or_a_folder_of_other_files_is_refused_before_the_target_loads(chat_pair, tmp_path, capsys):
    root, _ = chat_pair
    drafter = tmp_path / "other-drafter"  # an export, not the one evaluated (that one is an input: issue 71)
    shutil.copytree(root / "drafter", drafter)
    before = contents(drafter)
    assert cli(eval_argv(root, drafter, target=NO_TARGET)) == 2
    line = error_line(capsys)
    assert f"{drafter}: not a new report directory" in line and "config.json" in line and "--overwrite" in line
    assert NO_TARGET not in line and contents(drafter) == before
    assert cli(eval_argv(root, root / "drafter", "--overwrite", target=NO_TARGET)) == 2
    assert "is the input --drafter" in error_line(capsys)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    assert cli(eval_argv(root, notes, target=NO_TARGET)) == 2
    assert "todo.txt" in error_line(capsys) and contents(notes) == {"todo.txt": b"x"}


def test_overwrite_writes_the_report_beside_other_files_and_an_earlier_report_needs_it(chat_pair, tmp_path, capsys):
    root, _ = chat_pair
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    (out / "report.md").write_text("old\n")
    assert cli(eval_argv(root, out, "--overwrite")) == 0
    assert (out / "notes.txt").read_text() == "keep me\n"  # not eval's: never touched
    assert json.loads((out / "report.json").read_text())["overall"]["prompts"] == 1
    assert (out / "report.md").read_text() != "old\n"
    capsys.readouterr()
    fresh = tmp_path / "again"
    assert cli(eval_argv(root, fresh)) == 0  # a new directory needs no flag
    capsys.readouterr()
    first = (fresh / "report.json").read_bytes()
    assert cli(eval_argv(root, fresh)) == 2  # an earlier report is a measurement: not replaced unasked
    line = error_line(capsys)
    assert "an earlier report" in line and "--overwrite" in line and "pick another path" in line
    assert (fresh / "report.json").read_bytes() == first


# ----------------------------------------------------------------------------- numeric flags
@pytest.mark.parametrize("extra,said", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1 (prompts per dataset), got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1 (new tokens per prompt), got 0"),
    (["--time-limit", "-5"], "--time-limit must be >= 0 (seconds;"),
    (["--time-limit", "nan"], "--time-limit must be >= 0"),
    (["--concurrency", "-4"], "--concurrency must be >= 1 (requests in flight), got -4"),
    (["--concurrency", "4"], "--concurrency is read by --server and --engine vllm, not by --engine dflashkit"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
    (["--tree-budget", "1"], "--tree-budget must be >= 2"),
    (["--tree-top-k", "0"], "--tree-top-k must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0: greedy)"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--block-size", "1"], "--block-size must be >= 2"),
    (["--reference-prompts", "-1"], "--reference-prompts must be >= 0"),
    (["--engine", "vllm", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--engine", "vllm", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1"),
    (["--engine", "vllm", "--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--engine", "vllm", "--block-size", "3"], "--block-size is read by the dflashkit engine"),
    (["--engine", "vllm", "--time-limit", "60"], "--time-limit is read by the dflashkit engine"),
])
def test_a_flag_out_of_range_is_named_before_the_target_loads(chat_pair, tmp_path, capsys, extra, said):
    root, _ = chat_pair
    out = tmp_path / "r"
    assert cli(eval_argv(root, out, *extra, target=NO_TARGET)) == 2
    line = error_line(capsys)
    assert said in line and NO_TARGET not in line
    assert not out.exists()  # nothing made for a refused run


def test_a_block_size_beyond_the_drafters_is_refused(chat_pair, tmp_path, capsys):
    root, _ = chat_pair
    out = tmp_path / "r"
    assert cli(eval_argv(root, out, "--block-size", "100", target=NO_TARGET)) == 2
    line = error_line(capsys)
    assert "--block-size 100 is larger than the drafter's block_size 4" in line and "--block-size 4 or less" in line
    assert NO_TARGET not in line and not out.exists()


def test_server_timeout_and_concurrency_are_checked_before_any_request(tmp_path, capsys):
    """Port 9 (discard) would refuse the connection: the flags must be refused before it is tried."""
    assert cli(["eval", "--server", "http://127.0.0.1:9", "--concurrency", "2", "0"]) == 2
    assert "--concurrency must be >= 1" in error_line(capsys)
    assert cli(["eval", "--server", "http://127.0.0.1:9", "--timeout", "0"]) == 2
    assert "--timeout must be > 0 (seconds per request), got 0.0" in error_line(capsys)


# ----------------------------------------------------------------------------- --compare
GOOD = {"args": {"mode": "chain"}, "block_size": 4, "datasets": {"d.jsonl": {"tau": 2.0}}, "overall": {"tau": 2.0}}


@pytest.mark.parametrize("text,said", [
    ("{cut", "not valid JSON (line 1:"),
    ("[1, 2]", "holds a JSON list, not a report object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "overall"}), "field overall is missing"),
    (json.dumps({**GOOD, "overall": {"rounds": 3}}), "field overall.tau is missing"),
    (json.dumps({**GOOD, "overall": {"tau": "high"}}), 'field overall.tau is "high", expected a number'),
    (json.dumps({**GOOD, "block_size": "4"}), 'field block_size is "4", expected an integer'),
    (json.dumps({**GOOD, "datasets": {"d.jsonl": {"tau": None}}}), 'field datasets["d.jsonl"].tau is null'),
    (json.dumps({**GOOD, "datasets": {"d.jsonl": 5}}), 'field datasets["d.jsonl"] is 5, expected an object'),
])
def test_compare_names_the_report_and_the_field(tmp_path, capsys, text, said):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path, body in ((good, json.dumps(GOOD)), (bad, text)):
        path.mkdir()
        (path / "report.json").write_text(body)
    assert cli(["eval", "--compare", str(good), str(good)]) == 0
    capsys.readouterr()
    assert cli(["eval", "--compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    line = error_line(capsys)
    assert f"{bad / 'report.json'}: {said}" in line and "dflashkit eval --out DIR" in line
    assert not (tmp_path / "cmp").exists()


def _record(dataset, prompt_id, tokens, rounds, round_tokens):
    return {"dataset": dataset, "id": prompt_id, "prompt_tokens": 5, "rounds": rounds, "round_tokens": round_tokens,
            "tau": round_tokens / rounds, "tokens": tokens}


def test_compare_pairs_the_prompts_of_two_reports_outputs():
    """The same answers are counted, a parting answer gives the token where it parts (a shorter answer that is
    the other's start, its length), and τ of each report over the shared prompts and over those with the same
    answer come from their rounds; a prompt only one report ran is left out."""
    from dflashkit.eval.compare import paired_outputs

    first = {(r["dataset"], r["id"]): r for r in [
        _record("a", "1", [1, 2, 3, 4], 2, 3), _record("a", "2", [5, 6, 7, 8], 3, 3),
        _record("b", "1", [9, 9, 9, 9], 1, 3), _record("b", "2", [1, 1], 1, 1), _record("b", "9", [0], 1, 0)]}
    other = {(r["dataset"], r["id"]): r for r in [
        _record("a", "1", [1, 2, 3, 4], 1, 3), _record("a", "2", [5, 6, 0, 8], 1, 3),
        _record("b", "1", [9, 9, 9, 9], 3, 3), _record("b", "2", [1, 1, 4], 2, 2)]}
    got = paired_outputs(first, other)
    assert got == {"prompts": 4, "same_answers": 2, "median_first_difference": 2,
                   "tau_first": (3 + 3 + 3 + 1) / (2 + 3 + 1 + 1), "tau_other": (3 + 3 + 3 + 2) / (1 + 1 + 3 + 2),
                   "tau_first_same_answers": 6 / 3, "tau_other_same_answers": 6 / 4}
    assert paired_outputs(first, {})["tau_first"] is None


@pytest.mark.parametrize("line,said", [
    ("{cut", "line 2 is not JSON"),
    (json.dumps({**_record("d", "1", [1], 1, 1), "tokens": "1 2"}), "line 2: field tokens is missing or not list"),
    (json.dumps({k: v for k, v in _record("d", "1", [1], 1, 1).items() if k != "rounds"}),
     "line 2: field rounds is missing or not int"),
])
def test_compare_names_the_outputs_line_and_field(tmp_path, capsys, line, said):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path in (good, bad):
        path.mkdir()
        (path / "report.json").write_text(json.dumps(GOOD))
    (good / "outputs.jsonl").write_text(json.dumps(_record("d", "1", [1], 1, 1)) + "\n")
    (bad / "outputs.jsonl").write_text(json.dumps(_record("d", "0", [1], 1, 1)) + "\n" + line + "\n")
    assert cli(["eval", "--compare", str(good), str(good)]) == 0
    capsys.readouterr()
    assert cli(["eval", "--compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    assert f"{bad / 'outputs.jsonl'}: {said}" in error_line(capsys)
    assert not (tmp_path / "cmp").exists()


def test_compare_pairs_prompts_whose_dataset_file_sits_in_other_folders(tmp_path, capsys):
    """A report of another machine names the same dataset file under another folder: its prompts pair by the
    file's name and the prompt id; a prompt of another file does not pair."""
    here, there = tmp_path / "here", tmp_path / "there"
    for path, folder in ((here, "/work/data"), (there, "/root/data")):
        path.mkdir()
        (path / "report.json").write_text(json.dumps(GOOD))
        records = [_record(f"{folder}/humaneval.jsonl", "HumanEval/0", [1, 2, 3], 1, 2),
                   _record(f"{folder}/mtbench.jsonl", "81", [4, 5], 1, 1 if path == here else 2)]
        (path / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (there / "outputs.jsonl").write_text((there / "outputs.jsonl").read_text().replace("/root/data/mtbench",
                                                                                        "/root/data/other"))
    assert cli(["eval", "--compare", str(here), str(there)]) == 0
    assert f"| {there} | 1 | 1 | — | 2.000 | 2.000 | 2.000 | 2.000 |" in capsys.readouterr().out
