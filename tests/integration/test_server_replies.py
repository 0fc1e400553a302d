"""What `dflashkit regenerate --server` and `dflashkit eval --server` answer when an OpenAI-compatible server
replies something else than chat completions (not JSON, no choices, an error object, empty answers): one line,
exit status 2, naming the URL and what to check; and following that advice works. The server is a local HTTP
server in a thread whose replies each test chooses."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflashkit.cli import main as cli

from support.chat_data import REGENERATE_RECORDS, chat_records, write_jsonl


def error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err[-2000:]
    return lines[0]


def completion(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


def stream(content: str) -> bytes:
    events = [{"choices": [{"delta": {"content": word + " "}}]} for word in content.split()]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


HANG_UP, CUT_MID_REPLY = b"<hang up>", b"<cut mid-reply>"  # replies the server cuts instead of sending


class _Server(BaseHTTPRequestHandler):
    """Serves model ``m`` the way vLLM does under /v1 (chat completions, streamed when asked) unless ``reply``
    (path, request body) -> bytes says otherwise; anything else under the root is a web page."""

    reply = None

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (the http.server name)
        self._send(b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b"<html>a web page</html>")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        custom = type(self).reply(self.path, body) if type(self).reply else None
        if custom in (HANG_UP, CUT_MID_REPLY):
            self._cut(custom)
        elif custom is not None:
            self._send(custom)
        elif self.path != "/v1/chat/completions":
            self._send(b"<html>a web page</html>")
        else:
            answer = f"answer to {body['messages'][-1]['content'][:20]}"
            self._send(stream(answer) if body.get("stream") else completion(answer))

    def _cut(self, how: bytes) -> None:
        """The connection closed without a reply, or after the headers and 10 of 1000 announced bytes."""
        if how == CUT_MID_REPLY:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices"')
            self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    """(base URL, a function that sets the replies)."""
    handler = type("Handler", (_Server,), {"reply": None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", lambda fn: setattr(handler, "reply", staticmethod(fn))
    httpd.shutdown()
    httpd.server_close()


def regenerate_argv(url, data, out, *extra):
    return ["regenerate", "--server", url, "--model", "m", "--data", data, "--out", str(out), "--no-progress",
            "--concurrency", "1", *extra]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- regenerate
def test_a_web_page_instead_of_the_api_names_the_url_and_v1_fixes_it(server, tmp_path, capsys):
    url, _ = server
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:2])
    out = tmp_path / "out.jsonl"
    assert cli(regenerate_argv(url, data, out)) == 2  # the root, not /v1: a web page
    line = error_line(capsys, "dflashkit regenerate")
    assert f"{url}/chat/completions: the answer is not JSON (b'<html>a web page</html>')" in line
    assert "ending in /v1" in line
    assert cli(regenerate_argv(url + "/v1", data, out)) == 0  # the advice, followed
    assert [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows(out)] == \
        [["answer to alpha beta", "answer to gamma"], ["answer to delta echo fox"]]


@pytest.mark.parametrize("bad,said", [
    (b'{"choices": []}', """expected {"choices": [{"message": ...}]}, got b'{"choices": []}'"""),
    (b'{"choices": [{"text": "legacy completions"}]}', """expected {"choices": [{"message": ...}]}"""),
    (b'[1, 2]', """expected {"choices": [{"message": ...}]}, got b'[1, 2]'"""),
    (b'{"error": {"message": "The model `wrong` does not exist."}}',
     "the server answered with an error: 'The model `wrong` does not exist.'"),
])
def test_a_reply_without_a_message_names_the_url_and_resume_with_the_right_model_completes(
        server, tmp_path, capsys, bad, said):
    url, replies = server
    replies(lambda path, body: bad if body["model"] != "m" else None)  # a server that does not serve `wrong`
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:2])
    out = tmp_path / "out.jsonl"
    argv = regenerate_argv(url + "/v1", data, out)
    argv[argv.index("m")] = "wrong"
    assert cli(argv) == 2
    line = error_line(capsys, "dflashkit regenerate")
    assert f"{url}/v1/chat/completions: {said}" in line and "--model" in line and "--resume" in line
    assert cli([*regenerate_argv(url + "/v1", data, out), "--resume"]) == 0  # the advice, followed
    assert [r["index"] for r in rows(out)] == [0, 1]


@pytest.mark.parametrize("cut", [CUT_MID_REPLY, HANG_UP], ids=["incomplete_read", "remote_disconnected"])
def test_a_connection_cut_mid_reply_is_one_line_and_resume_completes(server, tmp_path, capsys, cut):
    """A server that dies while answering (http.client.IncompleteRead was a traceback): after the retries one line
    naming the URL and --resume; no line of the output is cut, and --resume against a working server completes
    the file."""
    url, replies = server
    replies(lambda path, body: cut if "delta" in body["messages"][-1]["content"] else None)  # conversation 1
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:2])
    out = tmp_path / "out.jsonl"
    assert cli(regenerate_argv(url + "/v1", data, out)) == 2
    line = error_line(capsys, "dflashkit regenerate")
    assert f"{url}/v1/chat/completions: " in line and "--resume" in line
    assert [r["index"] for r in rows(out)] in ([], [0])  # whole lines only (rows() parses each)
    replies(lambda path, body: None)
    assert cli([*regenerate_argv(url + "/v1", data, out), "--resume"]) == 0
    assert [r["index"] for r in rows(out)] == [0, 1]


def test_empty_answers_are_counted_and_none_usable_is_one_line(server, tmp_path, capsys):
    """A reasoning model that spends a small max_tokens thinking answers nothing: such conversations are skipped
    and counted, never written as answers; when nothing usable came back the command fails naming the counts,
    and the advice (more --max-new-tokens, --resume) completes the file."""
    url, replies = server
    replies(lambda path, body: completion("") if body["max_tokens"] < 64 or "gamma" in str(body) else None)
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:3])
    out = tmp_path / "out.jsonl"
    assert cli(regenerate_argv(url + "/v1", data, out, "--max-new-tokens", "16")) == 2
    line = error_line(capsys, "dflashkit regenerate")
    assert "the answers to all 3 conversations sent were empty" in line and "{'empty_answer': 3}" in line
    assert "raise --max-new-tokens (16)" in line and out.read_text() == ""
    # followed: two conversations answered; the one whose second turn the server leaves empty is counted
    assert cli(regenerate_argv(url + "/v1", data, out, "--max-new-tokens", "100", "--resume")) == 0
    assert [r["index"] for r in rows(out)] == [1, 2]
    assert "skipped {'empty_answer': 1}" in capsys.readouterr().err
    assert all(m["content"] for r in rows(out) for m in r["messages"])


def test_on_bad_fail_does_not_stop_on_an_empty_answer(server, tmp_path, capsys):
    """--on-bad fail is about the data's records: its advice ('fix the record') would be wrong for a server's
    empty answer, which is counted instead."""
    url, replies = server
    replies(lambda path, body: completion("") if "gamma" in str(body) else None)
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:2])
    out = tmp_path / "out.jsonl"
    assert cli(regenerate_argv(url + "/v1", data, out, "--on-bad", "fail")) == 0
    assert [r["index"] for r in rows(out)] == [1]
    assert "skipped {'empty_answer': 1}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- eval --server
def eval_argv(url, data, *extra):
    return ["eval", "--server", url, "--dataset", data, "--num-prompts", "2", "--concurrency", "1", "--timeout",
            "20", *extra]


@pytest.mark.parametrize("bad,said", [
    (b'{"error": {"message": "The model `wrong` does not exist."}}', "the stream carried no tokens, it began"),
    (b"data: [1]\n\ndata: [DONE]\n\n", "an event is not a JSON object: '[1]'"),
    (b'data: {"error": {"message": "The model `wrong` does not exist."}}\n\n',
     "the server sent an error: 'The model `wrong` does not exist.'"),
    (b'data: {"choices": [{"delta": {"content": ""}}], "usage": 7}\n\ndata: [DONE]\n\n',
     "the stream carried no tokens"),
])
def test_eval_with_no_answer_from_the_server_writes_no_report_and_the_right_model_measures(
        server, tmp_path, capsys, bad, said):
    url, replies = server
    replies(lambda path, body: bad if body["model"] != "m" else None)
    data = write_jsonl(tmp_path / "p.jsonl", chat_records(2))
    out = tmp_path / "report"
    assert cli(eval_argv(url, data, "--model", "wrong", "--out", str(out))) == 2
    line = error_line(capsys, "dflashkit eval")
    assert f"{url}/v1/chat/completions: 0 of 2 requests came back with tokens (model 'wrong'" in line
    assert said in line and "check --model against the server's /v1/models" in line
    assert not (out / "serving.json").exists()
    assert cli(eval_argv(url, data, "--model", "m", "--out", str(out))) == 0  # the advice, followed
    level = json.loads((out / "serving.json").read_text())["levels"][0]
    assert (level["successes"], level["failures"]) == (2, 0)
