"""The settings of `dflashkit extract`, `regenerate` and `verify`, written once (extract/options.py,
extract/shards/verify.py): each command's --help lists exactly the flags of its options class, a command line
parses into the object the library takes (its values converted), and what the run records comes from that object."""

import json
from pathlib import Path

import pytest

from dflashkit.cli import run_main
from dflashkit.extract import __main__ as extract_command
from dflashkit.extract import regenerate as regenerate_command
from dflashkit.extract.options import ExtractOptions, RegenerateOptions
from dflashkit.extract.shards import verify as verify_command
from dflashkit.extract.shards.manifest import read_manifest
from dflashkit.extract.shards.verify import VerifyOptions
from dflashkit.options import flag_fields, flag_name, parse_options

from support.chat_data import REGENERATE_RECORDS, chat_records, save_tiny_chat_target, write_jsonl

COMMANDS = [(extract_command, ExtractOptions), (regenerate_command, RegenerateOptions),
            (verify_command, VerifyOptions)]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


def listed_in_help(text: str) -> list[str]:
    """The first spelling of each argument --help lists (``-h`` for ``-h, --help``, ``dir`` for a positional)."""
    body = text[text.index("\n\n", text.index("usage:")):]  # past the usage lines
    body = body[body.index("\n\n", 2):]  # past the description
    return [line.split()[0].rstrip(",") for line in body.splitlines() if line.startswith("  ") and
            not line.startswith("   ")]


@pytest.mark.parametrize("command,options", COMMANDS, ids=["extract", "regenerate", "verify"])
def test_help_lists_exactly_the_flags_of_the_options_class(command, options, capsys):
    with pytest.raises(SystemExit) as stop:
        command.main(["--help"])
    assert stop.value.code == 0
    listed = listed_in_help(capsys.readouterr().out)
    assert sorted(listed) == sorted(["-h", *(flag_name(f) for f in flag_fields(options))])
    assert len(listed) == len(set(listed))  # each once


def test_an_extract_command_line_is_the_options_object_the_run_records(tiny, tmp_path):
    first, second = (write_jsonl(tmp_path / f"d{k}.jsonl", chat_records(n, seed=k)) for k, n in ((1, 3), (2, 2)))
    out = tmp_path / "shards"
    argv = ["--target", tiny, "--data", first, "--data", second, "--out", str(out), "--layer-ids", "0,2",
            "--max-length", "1024", "--overlong", "drop", "--batch-tokens", "300", "--bucket-window", "4",
            "--shard-size", "2KB", "--staging-size", "1MB", "--tokenize-workers", "0", "--codec", "fp8",
            "--chat-template-kwargs", '{"enable_thinking": false}', "--no-progress"]
    opts = parse_options(ExtractOptions, argv, extract_command.build_parser())
    assert opts == ExtractOptions(target=tiny, data=[first, second], out=str(out), layer_ids=[0, 2], max_length=1024,
                                  overlong="drop", batch_tokens=300, bucket_window=4, shard_size=2048,
                                  staging_size=1 << 20, tokenize_workers=0, codec="fp8",
                                  chat_template_kwargs={"enable_thinking": False}, progress=False)
    assert (opts.engine, opts.tensor_parallel_size, opts.max_batch_size) == ("hf", 1, 64)  # the defaults, once
    assert run_main("dflashkit extract", extract_command.main, argv) == 0
    manifest = read_manifest(out)
    assert manifest["args"] == {"max_length": 1024, "overlong": "drop", "on_bad": "skip", "limit": None,
                                "split": None, "batch_tokens": 300, "max_batch_size": 64, "bucket_window": 4,
                                "shard_size": 2048}
    assert (manifest["target_layer_ids"], manifest["codec"], manifest["template_kwargs"], manifest["engine"]) == (
        [0, 2], "fp8", {"enable_thinking": False}, {"name": "hf"})
    assert manifest["totals"]["samples"] == 5  # both files, indices continuing


def test_a_regenerate_command_line_is_the_options_object_the_rows_record(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:2])
    out = tmp_path / "out.jsonl"
    argv = ["--target", tiny, "--data", data, "--out", str(out), "--max-new-tokens", "3", "--temperature", "0.5",
            "--top-p", "0.9", "--top-k", "7", "--seed", "4", "--batch-size", "2", "--no-cuda-graph",
            "--decode-attention", "sdpa", "--chat-template-kwargs", '{"persona": "x"}', "--device", "cpu",
            "--dtype", "float32", "--no-progress"]
    opts = parse_options(RegenerateOptions, argv, regenerate_command.build_parser())
    assert opts == RegenerateOptions(target=tiny, data=[data], out=str(out), max_new_tokens=3, temperature=0.5,
                                     top_p=0.9, top_k=7, seed=4, batch_size=2, cuda_graph=False,
                                     decode_attention="sdpa", chat_template_kwargs={"persona": "x"}, device="cpu",
                                     dtype="float32", progress=False, api_key="sk-from-env")
    assert (opts.chunk_factor, opts.concurrency, opts.on_bad) == (8, 16, "skip")  # the defaults, once
    assert run_main("dflashkit regenerate", regenerate_command.main, argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and rows[0]["meta"] == rows[1]["meta"]
    assert {k: v for k, v in rows[0]["meta"].items() if k != "generator"} == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 7, "max_new_tokens": 3, "chat_template_kwargs": {"persona": "x"}}


def test_verify_takes_its_directory(tmp_path):
    assert parse_options(VerifyOptions, [str(tmp_path)], verify_command.build_parser()) == VerifyOptions(
        dir=str(tmp_path))


@pytest.mark.parametrize("command", [extract_command, regenerate_command], ids=["extract", "regenerate"])
@pytest.mark.parametrize("kwargs,why", [("{cut", "is not JSON"), ("[1]", "is not a JSON object")])
def test_chat_template_kwargs_must_be_a_json_object(command, kwargs, why, tmp_path, capsys):
    """A list used to reach the run and fail there with a traceback (exit 1); now the flag is refused (exit 2)."""
    argv = ["--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "d.jsonl"), "--out",
            str(tmp_path / "out"), "--chat-template-kwargs", kwargs]
    with pytest.raises(SystemExit) as stop:
        command.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --chat-template-kwargs: {kwargs!r} {why}" in err and "enable_thinking" in err
    assert not (tmp_path / "out").exists()
