"""The error convention of every command.

- A user error (bad flag, bad recipe field, a file that is missing or does not fit) raises ``UserError`` where the
  user's input is checked, with a one-line message that names the file, field or URL and the fix. The command
  prints ``dflashkit <command>: error: <message>`` and exits 2.
- Anything else is a failure (a bug, a full disk, a crashed worker): it propagates with its traceback and the
  command exits 1. That includes a plain ``ValueError`` or ``FileNotFoundError``: Python raises those for
  programming errors too (too many values to unpack, a shape mismatch, ``json.JSONDecodeError`` on a file the
  program wrote), so they are never read as bad input. Code that reads a user's file catches the library's error
  there and raises ``UserError`` naming the file.

This module imports nothing of the project, so every package may raise ``UserError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the file or field and the fix. Commands exit 2 on it.

    A ``ValueError`` subclass, so library functions that document ``ValueError`` for bad arguments still do."""


# what a command reports as bad input (exit 2); every other exception is a failure (exit 1)
USER_ERRORS = (UserError,)
