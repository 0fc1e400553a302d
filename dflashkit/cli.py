"""The `dflashkit` command: dispatches each subcommand to the module that implements it.

    dflashkit <command> [args...]      (each also runs as `python -m <module>`)

Exit status, the same for every command (dflashkit/errors.py): 0 done, 2 a ``UserError`` (one line that names the
file or field and the fix), 1 anything else, a ``ValueError`` included (a failure, with its traceback).
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from typing import Callable

from dflashkit.errors import USER_ERRORS

# subcommand -> (module with a `main(argv)`, one-line help)
COMMANDS = {
    "regenerate": ("dflashkit.extract.regenerate", "rewrite assistant turns with the target's own answers"),
    "extract": ("dflashkit.extract.__main__", "capture target-layer features into sharded datasets"),
    "verify": ("dflashkit.extract.shards.verify", "check a shard directory: sha256, shapes, NaN/Inf, manifest"),
    "init-drafter": ("dflashkit.train.init_drafter", "write a randomly initialised drafter export for a target"),
    "train": ("dflashkit.train.__main__", "train a drafter, online (target in the loop) or on feature shards"),
    "export": ("dflashkit.train.export", "export a training checkpoint as a drafter directory"),
    "eval": ("dflashkit.eval.__main__", "live speculative decoding: acceptance length, speedup, reports"),
    "demo": ("dflashkit.demo", "the whole pipeline on the SmolLM2 testbed, resumable by stage"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        from dflashkit import __version__

        print(f"dflashkit {__version__}: train DFlash block drafters and measure their acceptance\n")
        print("usage: dflashkit <command> [args...]   (dflashkit <command> --help for its flags)\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<14} {text}")
        return 0
    if argv[0] in ("-V", "--version"):
        from dflashkit import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dflashkit: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run_main(f"dflashkit {name}", module.main, rest)


def run_main(prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's ``main(argv)``: the one place where a ``UserError`` becomes one line and exit status 2.
    Every other exception propagates with its traceback (exit status 1), a plain ``ValueError`` or
    ``FileNotFoundError`` too: those can be bugs. Each ``python -m dflashkit.X`` ends with
    ``sys.exit(run_main("dflashkit X", main))``."""
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit fails the write (EFBIG), said in one line
    try:
        return int(main(argv) or 0)
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
