"""dflashkit/options.py: a command's parser built from its options dataclass, and back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dflashkit.options import build_parser, flag_fields, flag_name, option, parse_options


def _size(text: str) -> int:
    return int(text.rstrip("B")) * 2


@dataclass
class Demo:
    target: str = option(help="the target", required=True, group="target")
    data: list = option(help="chat data; repeat", action="append", required=True, group="data")
    max_length: int | None = option(None, help="longest sample", parse=int, group="data")
    codec: str = option("bf16", help="storage", choices=("bf16", "fp8"))
    size: int = option(8, help="bytes", parse=_size)
    resume: bool = option(False, help="continue a run")
    engine: str = option("all", help="for which engine", flag="--for", choices=("all", "vllm"))
    names: list = option(help="more names", nargs="*", default_factory=list)
    api: object = field(default=None)  # not a flag: given in Python only


def test_flags_are_the_fields_with_dashes_and_non_flags_stay_off_the_parser():
    assert [flag_name(f) for f in flag_fields(Demo)] == [
        "--target", "--data", "--max-length", "--codec", "--size", "--resume", "--for", "--names"]
    text = build_parser(Demo, prog="demo").format_help()
    text = text[text.index("\n\n"):]  # past the usage line
    assert "--max-length" in text and "--api" not in text
    assert text.index("target:") < text.index("--target") < text.index("data:") < text.index("--data")


def test_parse_fills_the_dataclass_with_defaults_and_parsed_values():
    opts = parse_options(Demo, ["--target", "t", "--data", "a", "--data", "b", "--size", "5B", "--resume",
                                "--for", "vllm"], api="API")
    assert opts == Demo(target="t", data=["a", "b"], max_length=None, codec="bf16", size=10, resume=True,
                        engine="vllm", names=[], api="API")
    # a typed default is kept as it is (argparse parses only string defaults)
    assert parse_options(Demo, ["--target", "t", "--data", "a"]).size == 8


def test_required_flags_and_bad_choices_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_options(Demo, ["--data", "a"])
    assert "--target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_options(Demo, ["--target", "t", "--data", "a", "--codec", "fp4"])
    assert "fp4" in capsys.readouterr().err


def test_a_default_factory_is_fresh_for_each_parse():
    a = parse_options(Demo, ["--target", "t", "--data", "a"])
    a.names.append("x")
    assert parse_options(Demo, ["--target", "t", "--data", "a"]).names == []
