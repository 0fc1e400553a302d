"""The `dflashkit` dispatcher and a command's `python -m` module entry point, run in a fresh process, agree: the
same one-line user error and exit status 2, no traceback (dflashkit/errors.py's convention, tests/unit/dflashkit/
test_cli.py)."""

import subprocess
import sys

from dflashkit.cli import main


def test_dispatcher_and_module_entry_points_agree(capsys):
    assert main(["no-such-command"]) == 2
    assert "commands: regenerate" in capsys.readouterr().err
    assert main(["init-drafter", "--target", "t", "--out", "o", "--layer-types", "diagonal"]) == 2
    assert capsys.readouterr().err == ("dflashkit init-drafter: error: --layer-types: unknown ['diagonal']; use full, "
                                       "sliding or a comma list of them\n")
    # the same command as `python -m`: same line, same status, no traceback
    proc = subprocess.run([sys.executable, "-m", "dflashkit.train.init_drafter", "--target", "t", "--out", "o",
                           "--layer-types", "diagonal"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("dflashkit init-drafter: error: --layer-types: unknown")
