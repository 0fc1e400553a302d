"""Shared fixtures: tiny configs built in code (no downloads)."""

import os
import subprocess
import time

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_until_paused(cmd, pause_at: str, pause_file, timeout: float = 300.0) -> subprocess.Popen:
    """Start ``cmd`` with the test-only pause hook armed at ``pause_at`` and return once the process sits there
    (it has written ``pause_file``). Fails if the process ends first: then the pause point was never reached."""
    pause_file.unlink(missing_ok=True)
    env = dict(os.environ, DFLASHKIT_TEST_PAUSE_AT=pause_at, DFLASHKIT_TEST_PAUSE_FILE=str(pause_file))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout  # a hang guard only: the outcome never depends on how long this takes
    while not pause_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"ended before reaching {pause_at}: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, f"{pause_at} not reached within {timeout} s"
        time.sleep(0.01)
    return proc
