"""One run per output (dflashkit/outputs.py: OutputLock): a second run stops at once in one line naming the
holder; a lock left by a dead process is taken over with a note; the ranks of one launch share the lock; the
lock is gone after a user error and after a SIGTERM-driven checkpoint exit.

The holder is a live subprocess that took the lock and wrote a ready file; the tests wait for that file (a hang
guard only, never a timing assumption), then act, then kill it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dflashkit.cli import main as cli
from dflashkit.outputs import LOCK_NAME, OutputLock

from support.paths import ROOT, TINY_RECIPE
from support.processes import run_until_paused
from support.shards import make_shards
from support.tiny_targets import make_tiny_target

HOLDER = """
import pathlib, sys, time
from dflashkit.outputs import OutputLock
lock = OutputLock(sys.argv[1], sys.argv[2], sidecar=sys.argv[3] == "file")
lock.acquire()
pathlib.Path(sys.argv[4]).write_text("ready")
time.sleep(600)
"""


def start_holder(target, command, ready, kind="dir", env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(target), command, kind, str(ready)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # a hang guard only
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the holder ended: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.01)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=60)


@pytest.fixture
def holder(tmp_path):
    procs = []

    def start(target, command, kind="dir", env=None):
        procs.append(start_holder(target, command, tmp_path / f"ready-{len(procs)}", kind, env))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            stop(p)


def refusal(capsys, pid: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"pid {pid} on {socket.gethostname()}, since " in err[0] and "in use by another dflashkit" in err[0]
    return err[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lock")
    target = make_tiny_target(root / "target")
    return target, make_shards(root / "shards", target, num_samples=6)


def train_argv(shards, out, *extra):
    return ["train", "--recipe", str(TINY_RECIPE), f"shards={shards}", f"output_dir={out}", "max_steps=1",
            "wandb=false", "progress=false", "num_workers=0", "eval_samples=1", *extra]


def test_a_second_train_into_one_output_dir_stops_naming_the_holder(tiny, tmp_path, holder, capsys):
    _, shards = tiny
    out = tmp_path / "run"
    proc = holder(out, "train")
    assert cli(train_argv(shards, out)) == 2
    assert "dflashkit train run" in refusal(capsys, proc.pid)
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid  # the holder's lock is left alone


def test_a_second_extract_regenerate_or_eval_stops_naming_the_holder(tmp_path, holder, capsys):
    out = tmp_path / "shards"
    proc = holder(out, "extract")
    assert cli(["extract", "--target", "testbed:smollm2", "--data", "builtin:mtbench", "--out", str(out)]) == 2
    refusal(capsys, proc.pid)
    regen = tmp_path / "regen.jsonl"
    proc = holder(regen, "regenerate", kind="file")
    assert (tmp_path / "regen.jsonl.lock").is_file()
    assert cli(["regenerate", "--target", "testbed:smollm2", "--data", "builtin:mtbench", "--out", str(regen)]) == 2
    refusal(capsys, proc.pid)
    assert not regen.exists()
    report = tmp_path / "report"
    proc = holder(report, "eval")
    assert cli(["eval", "--target", "testbed:smollm2", "--drafter", str(tmp_path / "d"), "--out", str(report)]) == 2
    refusal(capsys, proc.pid)


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tiny, tmp_path, capsys):
    _, shards = tiny
    out = tmp_path / "run"
    proc = start_holder(out, "train", tmp_path / "ready")
    stop(proc)  # killed: its lock file stays behind, its pid is dead
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid
    assert cli(train_argv(shards, out)) == 0
    err = capsys.readouterr().err
    assert f"took over the lock of a dflashkit train run that is no longer running (pid {proc.pid}" in err
    assert (out / "export" / "model.safetensors").is_file()
    assert not (out / LOCK_NAME).exists()  # released at the end


def test_ranks_of_one_launch_share_the_lock_and_another_launch_is_refused(tmp_path, holder, monkeypatch):
    out = tmp_path / "run"
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "job-7"}
    proc = holder(out, "train", env={**launch, "RANK": "0"})
    for key, value in {**launch, "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with OutputLock(out, "train") as rank1:
        assert rank1.shared
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid  # rank 1 leaves rank 0's lock in place
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")  # a second launch
    with pytest.raises(ValueError, match=f"pid {proc.pid} on "):
        OutputLock(out, "train").acquire()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=f"pid {proc.pid} on "):
        OutputLock(out, "train").acquire()


def test_the_lock_is_released_after_a_user_error(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    lock_seen = []

    class Spy(OutputLock):  # the real lock; records that the file existed while the run held it
        def acquire(self):
            super().acquire()
            lock_seen.append(json.loads(self.path.read_text())["pid"])

    import dflashkit.outputs

    monkeypatch.setattr(dflashkit.outputs, "OutputLock", Spy)
    assert cli(["train", f"shards={tmp_path / 'missing'}", f"output_dir={out}", "wandb=false"]) == 2
    assert lock_seen == [os.getpid()] and not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_sigterm_checkpoint_exit_releases_the_lock(tiny, tmp_path):
    _, shards = tiny
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflashkit.train", "--recipe", str(TINY_RECIPE), f"shards={shards}",
           f"output_dir={out}", "wandb=false", "progress=false", "num_workers=0", "eval_samples=1", "save_every=0"]
    proc = run_until_paused(cmd, "step-1-done", tmp_path / "paused", timeout=300)
    try:
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid  # held while it runs
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "stopped by SIGTERM" in err.decode() and not (out / LOCK_NAME).exists()


def test_a_file_of_the_users_at_the_lock_path_is_refused_and_kept(tmp_path):
    """A regular file that holds no lock record, or a symbolic link, where the lock goes: one line, nothing changed."""
    from dflashkit.errors import UserError

    notes = tmp_path / "notes.jsonl.lock"
    notes.write_text("my own notes\n")
    with pytest.raises(UserError, match="not a dflashkit lock"):
        OutputLock(tmp_path / "notes.jsonl", "regenerate", sidecar=True).acquire()
    assert notes.read_text() == "my own notes\n"
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_NAME).symlink_to(precious)
    with pytest.raises(UserError, match="lock"):
        OutputLock(tmp_path / "out", "train").acquire()
    assert precious.read_text() == "keep me\n" and (tmp_path / "out" / LOCK_NAME).is_symlink()


def test_single_node_launches_on_two_hosts_do_not_share_a_launch_id(monkeypatch):
    """torchrun's defaults (run id none, 127.0.0.1:29500) are the same on every node: the host tells them apart."""
    from dflashkit import outputs

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(outputs.socket, "gethostname", lambda: "node-a")
    a = outputs.launch_id()
    monkeypatch.setattr(outputs.socket, "gethostname", lambda: "node-b")
    assert a != outputs.launch_id() and "node-a" in a
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # a real rendezvous address is the same on every node of a launch
    assert outputs.launch_id() == "none@10.0.0.1:29500"
