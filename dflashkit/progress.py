"""Progress bars: one on a terminal, a line every few seconds in a log file or a pipe.

Every progress bar of the project (training, regeneration, extraction, eval) is made by ``progress_bar``.

Design choices:
- On a terminal a bar redraws itself in place, as tqdm does (``mininterval`` 0.1 s): nothing piles up.
- Without a terminal (a log file, a pipe, ``nohup``) every redraw would stay in the log: a GPU run of the demo left
  135 kB of bars. There the bar redraws at most every ``QUIET_INTERVAL_S`` seconds, and each redraw is one line
  (tqdm's carriage return becomes a newline), so a log reads as a short list of timestamps of the work.
- A postfix is set without a redraw of its own (``set_postfix(..., refresh=False)`` in the callers): it shows at the
  bar's next redraw, which the interval above paces.
- tqdm is imported here only, when a bar is made.
"""

from __future__ import annotations

import sys

QUIET_INTERVAL_S = 10.0  # seconds between two lines of a bar that writes to a file or a pipe


class LineStream:
    """A text stream for tqdm that writes each redraw as one line: the leading carriage return dropped, a newline
    after the text (a bare newline or an empty write, tqdm's clearing, writes nothing)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.lstrip("\r").rstrip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def on_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal (a stream without ``isatty`` is not)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(*, file=None, quiet_interval_s: float = QUIET_INTERVAL_S, **tqdm_kwargs):
    """A tqdm bar (``tqdm_kwargs`` as tqdm takes them) on ``file`` (default stderr): as tqdm draws it on a terminal;
    elsewhere at most one line every ``quiet_interval_s`` seconds (the module docstring)."""
    from tqdm import tqdm

    stream = sys.stderr if file is None else file
    if on_terminal(stream):
        return tqdm(file=stream, **tqdm_kwargs)
    tqdm_kwargs.pop("dynamic_ncols", None)  # no terminal to measure
    return tqdm(file=LineStream(stream), mininterval=quiet_interval_s, **tqdm_kwargs)
