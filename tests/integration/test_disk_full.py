"""A full disk is the environment's: one line, exit status 2, naming the path, the bytes the write needed where
known and the fix; nothing half-written stays, and the advice (run again, with --resume / --overwrite where the
command says so) completes the work. The disk is made full by a file-size limit (RLIMIT_FSIZE) on the command's
process, which fails its writes past the limit with EFBIG, as a full disk fails them with ENOSPC; both take the
same path (dflashkit/files.py DISK_FULL). Extraction's case: test_extract_faults.py."""

import json
import os
import resource
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.chat_data import chat_records, write_jsonl
from support.paths import ROOT
from support.shards import make_shards
from support.tiny_targets import make_tiny_target
from support.training import as_argv, tiny_overrides


def run_limited(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    """``dflashkit ARGV`` in a process whose files may not grow past ``limit`` bytes."""
    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "dflashkit", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, preexec_fn=small_disk,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_here(argv: list[str]) -> int:
    """``dflashkit ARGV`` in this process: the runs without a limit (the advice followed, a run to export) test
    nothing about a process."""
    from dflashkit.cli import main

    return main(argv)


def one_error_line(proc, command: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"dflashkit {command}: error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    return make_shards(root / "shards", make_tiny_target(root / "target"))


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_rerun_resumes(shards, tmp_path):
    out = tmp_path / "run"
    argv = ["train", *as_argv(tiny_overrides(shards, out, epochs=1, save_every=2))]
    proc = run_limited(argv, limit=16 << 10)  # metrics lines fit; the checkpoint's weights do not
    line = one_error_line(proc, "train")
    assert f"{out}/checkpoints/step-00000002: the file-size limit (ulimit -f) is reached (a write of " in line
    assert "bytes free on" in line and "run the same command again: it resumes from the last checkpoint" in line
    assert not list((out / "checkpoints").iterdir())  # no partial checkpoint, no temporary one
    assert run_here(argv) == 0  # the advice, followed
    assert json.loads((out / "summary.json").read_text())["step"] > 2


def test_a_full_disk_during_an_export_leaves_nothing_and_the_rerun_writes_it(shards, tmp_path):
    run = tmp_path / "run"
    assert run_here(["train", *as_argv(tiny_overrides(shards, run, epochs=1, save_every=2))]) == 0
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    out = tmp_path / "drafter"
    proc = run_limited(["export", str(checkpoint), str(out)], limit=16 << 10)
    line = one_error_line(proc, "export")
    assert f"{out}: the file-size limit (ulimit -f) is reached (a write of " in line and "then run the command" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither the export nor a temporary sibling
    assert run_here(["export", str(checkpoint), str(out)]) == 0  # the advice, followed
    assert (out / "model.safetensors").is_file()


class _Server(BaseHTTPRequestHandler):
    """model ``m`` answering every streamed chat completion with a few words."""

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (the http.server name)
        self._send(b'{"data": [{"id": "m"}]}')

    def do_POST(self):  # noqa: N802
        if json.loads(self.rfile.read(int(self.headers["Content-Length"]))).get("stream"):
            self._send(b"".join(b'data: {"choices": [{"delta": {"content": "w "}}]}\n\n' for _ in range(5))
                       + b"data: [DONE]\n\n")
        else:
            self._send(json.dumps({"choices": [{"message": {"content": "an answer " * 20}}]}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_full_disk_under_regenerates_output_is_one_line_and_resume_completes_it(server, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(12))
    out = tmp_path / "out.jsonl"
    argv = ["regenerate", "--server", f"{server}/v1", "--model", "m", "--data", data, "--out", str(out),
            "--concurrency", "1", "--no-progress"]
    line = one_error_line(run_limited(argv, limit=4096), "regenerate")  # the first few conversations fit
    assert f"{out}: the file-size limit (ulimit -f) is reached" in line
    assert "then run the same command again with --resume" in line
    assert 0 < len(out.read_bytes()) <= 4096
    assert run_here([*argv, "--resume"]) == 0  # the advice, followed
    assert [json.loads(r)["index"] for r in out.read_text().splitlines()] == list(range(12))


def test_a_full_disk_under_an_eval_report_is_one_line_with_the_bytes(server, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", chat_records(2))
    out = tmp_path / "report"
    argv = ["eval", "--server", server, "--dataset", data,
            "--num-prompts", "2", "--concurrency", "1", "--out", str(out)]
    line = one_error_line(run_limited(argv, limit=200), "eval")  # the report is larger than 200 bytes
    assert f"{out}/serving.json: the file-size limit (ulimit -f) is reached (a write of " in line
    assert line.endswith("then run the command again")
    assert not out.exists()  # no report, no temporary file, no empty directory
    assert run_here(argv) == 0  # the advice, followed
    assert json.loads((out / "serving.json").read_text())["levels"][0]["successes"] == 2
