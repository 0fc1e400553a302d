"""Stopping an evaluation early without losing it: Ctrl-C, SIGTERM or a time limit.

Design choices:
- The signal handlers only record the request; the loop finishes the prompt it is on, then writes the report
  of the prompts done, marked partial. A second Ctrl-C / SIGTERM acts as usual (the default handler is back).
- The time limit is checked after each prompt, so `--time-limit 0` stops after exactly one prompt.
- `pause_point(name)` is a test-only hook: when DFLASHKIT_TEST_PAUSE_AT equals `name` it writes `name` to the
  file DFLASHKIT_TEST_PAUSE_FILE and holds until a stop is requested, so a test can signal the process at an
  exact point of its work instead of after a delay. It does nothing when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


class StopRequest:
    """Use as a context manager around the prompt loop; `reason()` is None until a stop is due."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, time_limit_s: float | None = None):
        self.time_limit_s = time_limit_s  # seconds from entering the block (None: no limit)
        self.signal_name: str | None = None
        self._start = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        for sig, handler in self._previous.items():  # a second signal acts as usual
            signal.signal(sig, handler)

    def __enter__(self) -> "StopRequest":
        self._start = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def reason(self) -> str | None:
        if self.signal_name:
            return self.signal_name
        if self.time_limit_s is not None and time.monotonic() - self._start >= self.time_limit_s:
            return f"time limit {self.time_limit_s:g} s"
        return None

    def pause_point(self, name: str) -> None:
        if os.environ.get("DFLASHKIT_TEST_PAUSE_AT") != name:
            return
        Path(os.environ["DFLASHKIT_TEST_PAUSE_FILE"]).write_text(name)
        while self.signal_name is None:
            time.sleep(0.05)
