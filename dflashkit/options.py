"""A command's settings written once: a dataclass whose fields are its flags, from which its parser is built.

Each command (`dflashkit extract`, `regenerate`, `eval`, ...) declares one options dataclass beside the library
code that takes it. A field declared with ``option(...)`` is a flag: its name gives the flag (``max_length`` ->
``--max-length``), its default the flag's default, ``help`` its help, ``group`` the help section it is listed
under; the rest (``choices``, ``parse``, ``action``, ``nargs``, ``metavar``, ``required``, ``flag``) goes to
argparse as written. A field declared with a plain ``field(...)`` or a plain default is not on the command line
(what a caller in Python passes, e.g. a test's stand-in). ``parse_options`` returns the dataclass instance, so the
parser, the library call and the defaults cannot drift apart.

    @dataclass
    class ExtractOptions:
        target: str = option(help="HF model dir, .gguf file, or testbed:smollm2", required=True, group="target")
        max_length: int | None = option(None, help="longest sample in tokens", group="data")

    parser = build_parser(ExtractOptions, prog="dflashkit extract", description=__doc__)
    opts = parse_options(ExtractOptions, argv, parser)   # an ExtractOptions
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

_FLAG = "dflashkit.option"  # the metadata key that marks a field as a flag
_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, *, help: str, group: str | None = None, flag: str | None = None,
           choices=None, parse: Callable[[str], Any] | None = None, required: bool = False,
           default_factory: Callable[[], Any] | None = None, **argparse_extra) -> Any:
    """A dataclass field that is also a command-line flag (see the module notes). ``flag``: the flag's spelling
    when it is not the field's name with dashes (``"--for"``), or a positional name (no dashes). A required flag
    needs no default: its field defaults to None, and the parser refuses a command line without it.
    ``argparse_extra``: ``action``, ``nargs``, ``metavar``, given to argparse as written."""
    unknown = set(argparse_extra) - {"action", "nargs", "metavar"}
    if unknown:
        raise TypeError(f"option() got unexpected keyword arguments {sorted(unknown)}")
    arg = {"help": help, "group": group, "flag": flag, "choices": choices, "type": parse, "action": None,
           "nargs": None, "metavar": None, "required": required, **argparse_extra}
    if default is _MISSING and default_factory is None:
        default = None
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={_FLAG: arg})
    return dataclasses.field(default=default, metadata={_FLAG: arg})


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    """The spelling of a field's flag: ``--max-length`` for ``max_length`` unless the field names its own."""
    return f.metadata[_FLAG]["flag"] or "--" + f.name.replace("_", "-")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return None if f.default is _MISSING else f.default


def add_options(parser: argparse.ArgumentParser, cls) -> argparse.ArgumentParser:
    """Add every flag field of ``cls`` to ``parser``, each under its group's heading (groups in the order their
    first field comes)."""
    groups: dict[str | None, Any] = {None: parser}
    for f in flag_fields(cls):
        arg = dict(f.metadata[_FLAG])
        group_name, spelling = arg.pop("group"), flag_name(f)
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        kwargs = {k: v for k, v in arg.items() if v is not None and k != "flag"}
        default = _default_of(f)
        if arg["action"] is None and default is False and f.type in (bool, "bool"):
            kwargs["action"] = "store_true"
        if not spelling.startswith("-"):  # a positional argument
            kwargs.pop("required", None)
            groups[group_name].add_argument(spelling, default=default, **kwargs)
        else:
            if not kwargs.get("required"):
                kwargs.pop("required", None)
            groups[group_name].add_argument(spelling, dest=f.name, default=default, **kwargs)
    return parser


def build_parser(cls, *, prog: str, description: str | None = None, epilog: str | None = None,
                 raw: bool = True) -> argparse.ArgumentParser:
    """The parser of a command whose options are ``cls``. ``raw``: keep the description's line breaks (the
    command docstrings show commands line by line)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter if raw
                                     else argparse.HelpFormatter)
    return add_options(parser, cls)


def options_from(cls, namespace: argparse.Namespace, **extra):
    """An instance of ``cls`` from a parsed namespace (its flag fields), plus ``extra`` fields given in Python."""
    values = {f.name: getattr(namespace, f.name) for f in flag_fields(cls) if hasattr(namespace, f.name)}
    return cls(**values, **extra)


def parse_options(cls, argv: list[str] | None, parser: argparse.ArgumentParser | None = None, **extra):
    """Parse ``argv`` with ``parser`` (built from ``cls`` when not given) into an instance of ``cls``."""
    parser = parser or build_parser(cls, prog=cls.__name__)
    return options_from(cls, parser.parse_args(argv), **extra)
