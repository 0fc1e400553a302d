"""dflashkit/progress.py: a bar that writes to a file or a pipe stays quiet (a line per redraw, a redraw at most
every quiet interval); on a terminal it is tqdm's. Counted in lines, with no timing: the interval is one hour, so
every update of the loop falls inside it whatever the machine's speed."""

import io

from dflashkit.progress import LineStream, on_terminal, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_without_a_terminal_writes_few_whole_lines():
    log = io.StringIO()
    with progress_bar(file=log, total=5000, desc="train", quiet_interval_s=3600) as bar:
        for step in range(5000):
            bar.update()
            if step % 10 == 0:
                bar.set_postfix({"loss": f"{1 / (step + 1):.3f}"}, refresh=False)
    lines = log.getvalue().splitlines()
    assert len(lines) <= 3, lines  # the first draw and the last, not one per step
    assert "\r" not in log.getvalue() and lines[-1].startswith("train: 100%") and "5000/5000" in lines[-1]
    assert "loss=" in lines[-1]  # a postfix shows at the next redraw


def test_the_same_loop_with_no_interval_writes_a_line_per_step():
    log = io.StringIO()  # the interval is what keeps the lines few (the test above is not quiet by accident)
    with progress_bar(file=log, total=200, quiet_interval_s=0) as bar:
        for _ in range(200):
            bar.update()
    assert len(log.getvalue().splitlines()) > 100


def test_a_terminal_gets_tqdm_as_it_is():
    screen = Terminal()
    assert on_terminal(screen) and not on_terminal(io.StringIO()) and not on_terminal(object())
    with progress_bar(file=screen, total=3, quiet_interval_s=3600) as bar:
        assert bar.fp is not None and bar.mininterval == 0.1  # tqdm's default: redrawn in place
        bar.update(3)
    assert "\r" in screen.getvalue()


def test_line_stream_turns_redraws_into_lines_and_drops_clearing():
    log = io.StringIO()
    stream = LineStream(log)
    for text in ("\rstep 1   ", "\r", "\n", "", "\rstep 2"):
        stream.write(text)
    assert log.getvalue() == "step 1\nstep 2\n" and not stream.isatty()
