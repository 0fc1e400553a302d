"""A manifest that names a device as a shard (/dev/zero, or a link to it inside the directory) is refused, not
read: `verify` and `train` once hashed such an endless file forever. Each command runs in a fresh process with a
timeout, so a hang fails the test instead of hanging it (the other untrusted-manifest cases run in process:
tests/unit/dflashkit/test_untrusted_manifests.py)."""

import os
import subprocess
import sys

import pytest

from support.manifests import copy_shards, edit_manifest, one_error_line, train_argv
from support.paths import ROOT


def run_command(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m dflashkit ARGV`` in a fresh process; a hang fails the test at the timeout instead of hanging it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dflashkit", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # two commands in fresh processes
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_named_as_a_shard_is_refused_not_read(tiny_run, tmp_path):
    """/dev/zero with bytes 0 used to make `verify` and `train` hash an endless file."""
    shards = copy_shards(tiny_run, tmp_path)

    def to_dev_zero(m):
        m["shards"][0].update(file="/dev/zero", bytes=0)

    edit_manifest(shards, to_dev_zero)
    proc = run_command("verify", str(shards))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "shards[0].file is '/dev/zero'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_command(*train_argv(shards, tmp_path / "run"))
    assert proc.returncode == 2
    line = one_error_line(proc.stderr, "dflashkit train")
    assert "manifest.json: shards[0].file is '/dev/zero'" in line and "no absolute path" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # a command in a fresh process
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_link_to_a_device_inside_the_directory_is_refused(tiny_run, tmp_path):
    shards = copy_shards(tiny_run, tmp_path)
    os.symlink("/dev/zero", shards / "zero.safetensors")
    edit_manifest(shards, lambda m: m["shards"][0].update(file="zero.safetensors", bytes=0))
    proc = run_command("verify", str(shards))
    assert proc.returncode == 1 and "outside" in proc.stderr and "Traceback" not in proc.stderr
