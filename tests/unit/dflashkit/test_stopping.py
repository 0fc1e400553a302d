"""The one stop handler (dflashkit/stopping.py): a signal becomes a flag (or, asked for, a KeyboardInterrupt), the
previous handlers come back, and a time limit counts from entering the block. The signals are sent to this
process itself, from the main thread, so each lands before the next statement runs."""

import os
import signal

import pytest

from dflashkit.stopping import StopRequest


def _mark(seen):
    def handler(signum, frame):
        seen.append(signum)

    return handler


def test_a_signal_becomes_a_flag_and_the_second_reaches_the_previous_handler():
    seen = []
    before = signal.signal(signal.SIGTERM, _mark(seen))
    try:
        with StopRequest() as stop:
            assert not stop.requested and stop.reason() is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and stop.reason() == "SIGTERM" and seen == []
            os.kill(os.getpid(), signal.SIGTERM)  # the first signal gave the previous handler back
            assert seen == [signal.SIGTERM]
        assert stop.signal_name == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_previous_handlers_come_back_when_the_block_ends():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle
    assert {s: signal.getsignal(s) for s in previous} == previous
    assert not stop.requested


def test_interrupt_mode_raises_keyboard_interrupt_on_every_signal():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with StopRequest(interrupt=True) as stop:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except KeyboardInterrupt:
                pass
            assert stop.signal_name == "SIGTERM"
            os.kill(os.getpid(), signal.SIGTERM)  # still ours: a second signal interrupts too
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_time_limit_of_zero_is_due_at_once_and_none_never():
    with StopRequest(time_limit_s=0) as stop:
        assert stop.reason() == "time limit 0 s" and not stop.requested
    with StopRequest(time_limit_s=None) as stop:
        assert stop.reason() is None
    with StopRequest(time_limit_s=3600) as stop:
        assert stop.reason() is None


def test_the_pause_point_does_nothing_when_unarmed(monkeypatch):
    monkeypatch.delenv("DFLASHKIT_TEST_PAUSE_AT", raising=False)
    with StopRequest() as stop:
        stop.pause_point("anywhere")  # returns at once (a hold would hang this test)
        assert not stop.requested


def test_an_armed_pause_point_holds_until_a_signal(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHKIT_TEST_PAUSE_AT", "here")
    monkeypatch.setenv("DFLASHKIT_TEST_PAUSE_FILE", str(tmp_path / "paused"))
    with StopRequest() as stop:
        # SIGALRM -> a SIGTERM to ourselves, while the hook holds (the hook returns only once it has landed)
        previous_alarm = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGTERM))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            stop.pause_point("here")
        finally:
            signal.signal(signal.SIGALRM, previous_alarm)
        assert (tmp_path / "paused").read_text() == "here" and stop.reason() == "SIGTERM"
