"""`dflashkit eval`'s settings written once (eval/options.py): its --help lists exactly the flags of `EvalOptions`,
its checks' tables name its fields, and a command line becomes the options object the library receives."""

import json
import re
from dataclasses import fields

import pytest

from dflashkit.eval import run as eval_run
from dflashkit.eval.__main__ import __doc__ as EVAL_DOC
from dflashkit.eval.__main__ import build_parser, main, parse_command_line
from dflashkit.eval.options import ENGINE_ONLY, FLAG_RANGES, EvalOptions, decode_config
from dflashkit.options import flag_fields, flag_name

pytestmark = pytest.mark.usefixtures("one_thread")


def help_flags(text: str) -> list[str]:
    """The option strings --help lists, in order: the argument lines of its sections, before the epilog (the
    module's docstring, whose command examples name flags too)."""
    sections = text[:text.rindex(EVAL_DOC.splitlines()[0])]
    return [flag for line in sections.splitlines() if re.match(r"\s{2}-", line)
            for flag in re.findall(r"(?:^|, )(-{1,2}[a-z][a-z0-9-]*)", line.strip())]


def test_help_lists_exactly_the_flags_of_the_options_class():
    declared = [flag_name(f) for f in flag_fields(EvalOptions)]
    assert len(declared) == len(fields(EvalOptions)) == 47  # every field is a flag; none is Python-only
    listed = help_flags(build_parser().format_help())
    assert sorted(listed) == sorted(["-h", "--help", *declared])  # each once (sections keep their own order)


def test_the_check_tables_name_numeric_flags_of_the_options_class():
    kinds = {f.name: f.type for f in fields(EvalOptions)}
    assert set(FLAG_RANGES) <= set(kinds) and all(re.match(r"(list\[)?(int|float)", kinds[n]) for n in FLAG_RANGES)
    for engine, refused in ENGINE_ONLY.items():
        assert set(refused) <= set(kinds), engine
        assert all(getattr(EvalOptions(), name) is None for name in refused)  # None: "not given", never refused


def typical(root, out) -> list[str]:
    return ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dataset", "builtin:mtbench",
            "builtin:humaneval", "--num-prompts", "1", "--max-new-tokens", "4", "--mode", "tree", "--tree-budget", "6",
            "--tree-top-k", "2", "--baseline-prompts", "1", "--reference-prompts", "0", "--no-stop", "--device", "cpu",
            "--chat-template-kwargs", "{}", "--out", str(out)]


def test_a_typical_command_line_is_the_options_object_the_library_receives(chat_pair, tmp_path, monkeypatch):
    root, _ = chat_pair
    argv = typical(root, tmp_path / "r")
    expected = EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"),
                           dataset=["builtin:mtbench", "builtin:humaneval"], num_prompts=1, max_new_tokens=4,
                           mode="tree", tree_budget=6, tree_top_k=2, baseline_prompts=1, reference_prompts=0,
                           no_stop=True, device="cpu", chat_template_kwargs="{}", out=str(tmp_path / "r"))
    assert parse_command_line(argv) == expected
    assert expected.template_kwargs() == {} and expected.prefix_caching == ["on", "off"] and expected.seed == 0

    received = []
    real = eval_run.run_eval

    def recording(opts, config=None, shared_baseline=None):  # the real run, its arguments kept
        received.append((opts, config))
        return real(opts, config, shared_baseline)

    monkeypatch.setattr(eval_run, "run_eval", recording)
    assert main(argv) == 0
    (opts, config), = received
    assert opts == expected and config == decode_config(expected)  # stop ids stay empty: --no-stop
    args = json.loads((tmp_path / "r" / "report.json").read_text())["args"]
    assert (args["datasets"], args["num_prompts"], args["baseline_prompts"], args["mode"], args["tree_budget"],
            args["use_stop_tokens"], args["chat_template_kwargs"]) == (
        ["builtin:mtbench", "builtin:humaneval"], 1, 1, "tree", 6, False, {})
