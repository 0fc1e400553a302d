"""Stopping a long command without losing its work: Ctrl-C, SIGTERM or a time limit.

Used by training (a checkpoint at the next step boundary), eval (a partial report after the current prompt) and
regeneration (the conversations already answered are written).

Design choices:
- The handlers only record the signal; the command checks ``requested`` / ``reason()`` between its steps and
  finishes cleanly. The first signal puts the previous handlers back, so a second Ctrl-C / SIGTERM acts as it
  would without this handler.
- ``interrupt=True`` is for a command whose step cannot be split (one call answers a whole chunk of
  conversations): every Ctrl-C or SIGTERM raises KeyboardInterrupt at once, as Python's own Ctrl-C handler
  does, so SIGTERM (a scheduler, a time limit, torchrun passing on Ctrl-C) stops like Ctrl-C and the caller's
  ``except KeyboardInterrupt`` keeps what is done. The handlers then stay until the block ends.
- The time limit counts from entering the block and is checked by ``reason()``, so a limit of 0 stops after
  exactly one step.
- Handlers are installed from the main thread only (Python allows no other); elsewhere only the time limit acts.
- ``pause_point(name)``: the test-only hook of dflashkit/files.py, held until a stop is requested, so a test can
  signal the process at an exact point of its work.
"""

from __future__ import annotations

import signal
import threading
import time

from dflashkit.files import pause_point


class StopRequest:
    """A context manager around a command's loop; ``reason()`` is None until a stop is due."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, time_limit_s: float | None = None, interrupt: bool = False):
        self.time_limit_s = time_limit_s  # seconds from entering the block (None: no limit)
        self.interrupt = interrupt  # raise KeyboardInterrupt on every signal instead of only recording it
        self.signal_name: str | None = None  # the signal received, e.g. "SIGTERM"
        self.agreed = False  # set by a caller whose processes vote: every rank stops at the same step
        self._start = time.monotonic()
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        """This process got a signal."""
        return self.signal_name is not None

    def reason(self) -> str | None:
        """The signal's name, or the time limit once it has passed, else None."""
        if self.signal_name:
            return self.signal_name
        if self.time_limit_s is not None and time.monotonic() - self._start >= self.time_limit_s:
            return f"time limit {self.time_limit_s:g} s"
        return None

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self.interrupt:
            raise KeyboardInterrupt(f"signal {self.signal_name}")
        self._restore()  # a second signal acts as usual

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        self._start = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def pause_point(self, name: str) -> None:
        """Test hook: armed at ``name``, hold here until a stop is requested (does nothing when unarmed)."""
        pause_point(name, until=lambda: self.requested)
