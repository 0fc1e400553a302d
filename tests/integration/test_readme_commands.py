"""Every command that README.md (and each command's own docstring) shows is parsed by that command's real argument
parser, without running it: `dflashkit X ...`, `python -m dflashkit.X ...`, and the `-m dflashkit.X ...` part of
`accelerate launch` / `torchrun` lines. A training command also builds its TrainConfig from the recipe and the
key=value overrides, so a documented field that does not exist fails here too."""

import argparse
import importlib
import importlib.util
import re
import shlex

import pytest

from dflashkit.cli import COMMANDS

from support.paths import ROOT

LAUNCHERS = ("accelerate", "torchrun")


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def docstring_lines(text: str) -> list[str]:
    """The indented example lines of a module docstring (the commands it shows), continuations included."""
    return ["\n".join(line.strip() for line in text.splitlines() if line.startswith("    "))]


def command_lines(block: str) -> list[str]:
    """Lines of a shell block with backslash continuations joined (docstrings write them as a doubled backslash)."""
    joined = re.sub(r"\\\\?\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def module_of(name: str) -> str:
    """The module whose main(argv) runs ``python -m name``."""
    return f"{name}.__main__" if importlib.util.find_spec(name).submodule_search_locations else name


def dflashkit_command(line: str) -> tuple[str, list[str]] | None:
    """(module, argv) of a documented dflashkit command, or None for any other line."""
    words = shlex.split(line, comments=True)
    if not words:
        return None
    if words[0] == "dflashkit" and len(words) > 1 and words[1] in COMMANDS:
        return COMMANDS[words[1]][0], words[2:]
    if words[0] in ("python", "python3") + LAUNCHERS and "-m" in words:
        k = words.index("-m")
        if words[k + 1].startswith("dflashkit.") and (words[0] in LAUNCHERS or k == 1):
            return module_of(words[k + 1]), words[k + 2:]
    return None


def parse(module_name: str, argv: list[str]):
    """Parse ``argv`` exactly as the command's main does; argparse's own refusal becomes a test failure."""
    module = importlib.import_module(module_name)
    parse_args = getattr(module, "parse_args", None) or module.build_parser().parse_args
    try:
        args = parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{module_name} rejects {argv}: argparse exit {e.code}")
    if hasattr(module, "config_from_args"):  # train: the recipe and every key=value must make a TrainConfig
        module.config_from_args(args)
    return args


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) for every dflashkit command in README.md and in the commands' docstrings."""
    found = []
    for block in fenced_blocks((ROOT / "README.md").read_text()):
        found += [("README.md", *c) for c in map(dflashkit_command, command_lines(block)) if c]
    for module_name, _ in COMMANDS.values():
        doc = importlib.import_module(module_name).__doc__ or ""
        for block in docstring_lines(doc):
            found += [(f"{module_name} docstring", *c) for c in map(dflashkit_command, command_lines(block)) if c]
    return found


def test_the_extraction_finds_the_documented_commands():
    """The finder itself: joined continuations, launcher prefixes, and enough commands that the test means
    something (the fine-tuning and the online training commands among them)."""
    assert command_lines("a\\\n  b c\n# x\nd") == ["a b c", "d"]
    assert dflashkit_command("accelerate launch --num_processes 8 -m dflashkit.extract --out x") == (
        "dflashkit.extract.__main__", ["--out", "x"])
    assert dflashkit_command("torchrun --standalone -m dflashkit.extract.regenerate --out y") == (
        "dflashkit.extract.regenerate", ["--out", "y"])
    assert dflashkit_command("python -m sglang.launch_server --model-path m") is None
    assert dflashkit_command("make demo   # sets up .venv") is None
    readme = [c for c in documented_commands() if c[0] == "README.md"]
    assert len(readme) >= 12
    modules = {m for _, m, _ in readme}
    assert {"dflashkit.train.__main__", "dflashkit.extract.__main__", "dflashkit.extract.regenerate",
            "dflashkit.extract.shards.verify", "dflashkit.train.export", "dflashkit.eval.__main__"} <= modules
    assert any("--init-from" in argv and "lr=1e-4" in argv for _, _, argv in readme)


@pytest.mark.parametrize("where,module_name,argv", documented_commands(),
                         ids=lambda v: v if isinstance(v, str) and not v.startswith("dflashkit.") else None)
def test_every_documented_command_parses(where, module_name, argv, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes/... paths are relative to the repository
    assert isinstance(parse(module_name, argv), argparse.Namespace), where


def test_train_takes_key_value_overrides_before_between_and_after_flags(monkeypatch):
    """The README's fine-tuning command put lr=1e-4 after --init-from, which the parser used to reject."""
    from dflashkit.train.__main__ import config_from_args, parse_args

    monkeypatch.chdir(ROOT)
    args = parse_args(["--recipe", "recipes/qwen3-8b.yaml", "shards=data/d", "--init-from", "drafter/", "lr=1e-4",
                       "epochs=2", "--loss", "ce", "output_dir=runs/x"])
    cfg = config_from_args(args)
    assert (cfg.shards, cfg.init_from, cfg.lr, cfg.epochs, cfg.loss, cfg.output_dir) == (
        "data/d", "drafter/", 1e-4, 2, "ce", "runs/x")
    from dflashkit.train.init_drafter import parse_args as init_args

    assert init_args(["--target", "t", "seed=3", "--out", "o", "lr=1"]).overrides == ["seed=3", "lr=1"]


def test_a_readme_command_that_names_an_unknown_field_fails(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match="unknown field 'learning_rate'"):
        parse("dflashkit.train.__main__", ["--recipe", "recipes/qwen3-8b.yaml", "shards=d", "learning_rate=1"])
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        parse("dflashkit.extract.shards.verify", ["a", "b"])
