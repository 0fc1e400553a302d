"""One exit-status convention for every command (dflashkit/errors.py): a user error prints one line that names
the file or field and the fix, and exits 2; a failure keeps its traceback and exits 1."""

import pytest

from dflashkit.cli import COMMANDS, run_main
from dflashkit.errors import UserError

from support.paths import ROOT


def test_user_errors_are_one_line_and_exit_2(capsys):
    def bad_flag(argv):
        raise UserError("--widgets: 3 is too many; pass at most 2")

    def missing_file(argv):
        raise UserError("recipe r.yaml: no such file (see recipes/*.yaml)")

    assert run_main("dflashkit x", bad_flag, []) == 2
    assert capsys.readouterr().err == "dflashkit x: error: --widgets: 3 is too many; pass at most 2\n"
    assert run_main("dflashkit x", missing_file, []) == 2
    assert capsys.readouterr().err == "dflashkit x: error: recipe r.yaml: no such file (see recipes/*.yaml)\n"


@pytest.mark.parametrize("error", [RuntimeError("worker died"), ValueError("too many values to unpack"),
                                   FileNotFoundError("/tmp/x/shard-00003.safetensors")])
def test_failures_propagate_with_their_traceback(error, capsys):
    # a plain ValueError or FileNotFoundError is what Python raises for bugs too: never one line and exit 2
    def crash(argv):
        raise error

    with pytest.raises(type(error), match=str(error)):
        run_main("dflashkit x", crash, [])
    assert capsys.readouterr().err == ""


def test_every_module_entry_point_goes_through_run_main():
    root = ROOT
    folders = {"dflashkit": "dflashkit", "drafter": "drafter", "targets": "targets", "extract": "extract",
               "train": "train", "eval": "eval"}
    for name, (module, _) in COMMANDS.items():
        if name == "demo":  # the demo's stages are these commands; its own errors are user errors of its flags
            continue
        package, *rest = module.split(".")[1:]
        path = root / folders[package] / ("/".join(rest) + ".py" if rest else "__init__.py")
        assert f'run_main("dflashkit {name}", main)' in path.read_text(), f"{path}: use dflashkit.cli.run_main"
