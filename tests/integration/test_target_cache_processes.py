"""The target cache shared by processes: two processes that need the same GGUF conversion on a fresh cache (a
regeneration beside the quality script's warm-up run, the ranks of one launch) convert it once
(targets/gguf_cache.py conversion_lock)."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashkit.targets.gguf_cache import _SOURCE_MARKER, conversion_lock
from dflashkit.targets.loading import TESTBEDS, resolve_target_dir

pytestmark = pytest.mark.slow


def _waiting_for_flock(pid: int) -> bool:
    """Whether process ``pid`` waits for a flock (Linux lists waiters in /proc/locks with '->')."""
    return any("->" in line and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_second_process_waits_for_the_conversion_and_reuses_it(tmp_path):
    """Two processes that need the same GGUF conversion on a fresh cache (a regeneration beside a warm-up run):
    the second waits on the conversion lock, finds the first's finished copy and converts nothing itself. Here
    the test holds the lock and plays the first process: the conversion it leaves is the testbed's files linked
    in, which a second conversion would have replaced with its own."""
    testbed_dir, _ = resolve_target_dir("testbed:smollm2")  # the cache's own copy, converted once
    package, name = TESTBEDS["smollm2"]
    gguf = Path(importlib.util.find_spec(package).origin).parent / name
    out = tmp_path / "smollm2"
    code = ("import sys; from pathlib import Path; from dflashkit.targets.gguf_cache import cached_gguf_conversion; "
            "print(cached_gguf_conversion(Path(sys.argv[1]), Path(sys.argv[2])))")
    with conversion_lock(out):
        child = subprocess.Popen([sys.executable, "-c", code, str(gguf), str(out)], stdout=subprocess.PIPE,
                                 text=True)
        deadline = time.monotonic() + 300  # liveness only: the child imports torch, then blocks on the lock
        while not _waiting_for_flock(child.pid):
            assert child.poll() is None and time.monotonic() < deadline, "the child never waited on the lock"
            time.sleep(0.2)
        out.mkdir()
        for file in testbed_dir.iterdir():
            (out / file.name).symlink_to(file)
    stdout, _ = child.communicate(timeout=600)
    assert child.returncode == 0 and stdout.strip() == str(out)
    assert all(f.is_symlink() for f in out.iterdir()), "the waiting process converted again"
    assert json.loads((out / _SOURCE_MARKER).read_text())["gguf"] == gguf.name
    assert not list(tmp_path.glob(".smollm2.tmp-*"))
