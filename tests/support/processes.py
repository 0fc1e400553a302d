"""Commands in subprocesses: a checked run from the repository root, a run held at a test-only pause point, and
the accelerate launcher."""

import os
import subprocess
import sys
import time

from .paths import ROOT

ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]  # works without the console script


def run_checked(cmd, timeout: float = 900) -> str:
    """Run a command from the repository root on one thread; fail with its output unless it exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


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
