"""The `dflashkit` command: dispatches each subcommand to the module that implements it.

    dflashkit <command> [args...]      (each also runs as `python -m <module>`)
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a `main(argv)`, one-line help)
COMMANDS = {
    "regenerate": ("dflashkit.extract.regenerate", "rewrite assistant turns with the target's own answers"),
    "extract": ("dflashkit.extract.__main__", "capture target-layer features into sharded datasets"),
    "verify": ("dflashkit.extract.verify", "check a shard directory: sha256, shapes, NaN/Inf, manifest"),
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
    try:
        return int(module.main(rest) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"dflashkit {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
