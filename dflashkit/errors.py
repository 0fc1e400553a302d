"""The error convention of every command.

- A user error (bad flag, bad recipe field, a file that is missing or does not fit) raises ``UserError`` where the
  user's input is checked, with a one-line message that names the file, field or URL and the fix. The command
  prints ``dflashkit <command>: error: <message>`` and exits 2.
- Anything else is a failure (a bug, a crashed worker): it propagates with its traceback and the
  command exits 1. That includes a plain ``ValueError`` or ``FileNotFoundError``: Python raises those for
  programming errors too (too many values to unpack, a shape mismatch, ``json.JSONDecodeError`` on a file the
  program wrote), so they are never read as bad input. Code that reads a user's file catches the library's error
  there and raises ``UserError`` naming the file.
- A full disk (or a file size or quota limit) met by a durable write is the environment's, not a bug: the write
  helpers (dflashkit/files.py) raise ``UserError`` naming the path and the bytes it needed.
- A value the user gave is quoted through ``shown``: a 100 KB key or value is cut, not echoed whole.

This module imports nothing of the project, so every package may raise ``UserError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the file or field and the fix. Commands exit 2 on it.

    A ``ValueError`` subclass, so library functions that document ``ValueError`` for bad arguments still do."""


def shown(value, limit: int = 80) -> str:
    """``value`` as an error message quotes it: its ``repr``, cut to about ``limit`` characters with an ellipsis and
    the full length where it is longer, so one line stays one readable line whatever the user passed."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value))} characters)"


# what a command reports as bad input (exit 2); every other exception is a failure (exit 1)
USER_ERRORS = (UserError,)
