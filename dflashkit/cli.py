"""The `dflashkit` command: dispatches each subcommand to the module that implements it.

    dflashkit <command> [args...]      (each also runs as `python -m <module>`)
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a `main(argv)`, one-line help)
COMMANDS = {
    "init-drafter": ("dflashkit.train.init_drafter", "write a randomly initialised drafter export for a target"),
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
    try:
        return int(module.main(rest) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"dflashkit {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
