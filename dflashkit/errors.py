"""The error convention of every command.

- A user error (bad flag, bad recipe field, a file that is missing or does not fit) raises ``UserError`` (or, as
  the library does throughout, ``ValueError`` / ``FileNotFoundError``) with a one-line message that names the
  file or field and the fix. The command prints ``dflashkit <command>: error: <message>`` and exits 2.
- Anything else is a failure (a bug, a full disk, a crashed worker): it propagates with its traceback and the
  command exits 1.

This module imports nothing of the project, so every package may raise ``UserError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the file or field and the fix. Commands exit 2 on it."""


# what a command reports as bad input (exit 2); every other exception is a failure (exit 1)
USER_ERRORS = (ValueError, FileNotFoundError)
