"""`dflashkit regenerate`: batched greedy answers equal a plain argmax loop per conversation, turn by turn;
resume after a cut line; an OpenAI-compatible server (a fake one here) gets one request per turn."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflashkit.cli import run_main
from dflashkit.extract.__main__ import main as extract_main
from dflashkit.extract.regenerate import main as regenerate_main
from dflashkit.extract.shards.manifest import read_manifest

from support.chat_data import (
    REGENERATE_RECORDS,
    greedy_reference,
    save_tiny_chat_target,
    smollm2_tokenizer,
    write_jsonl,
)


def main(argv):
    """The command as `dflashkit regenerate` runs it: a user error is one line on stderr and exit status 2."""
    return run_main("dflashkit regenerate", regenerate_main, argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # large random weights: answers vary from token to token instead of repeating one
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target", initializer_range=0.5)


def test_greedy_answers_equal_an_argmax_loop_turn_by_turn(tiny, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS)
    out = tmp_path / "out.jsonl"
    assert main(["--target", tiny, "--data", data, "--out", str(out), "--max-new-tokens", "6", "--batch-size", "3",
                 "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 4]  # the plain-text record has no user turn: skipped
    for row in rows:
        msgs = row["messages"]
        assert "old" not in json.dumps(msgs)
        users = [m for m in msgs if m["role"] == "user"]
        assert [m["role"] for m in msgs if m["role"] != "system"] == ["user", "assistant"] * len(users)
        for k, m in enumerate(msgs):  # each answer is the target's greedy answer to everything before it
            if m["role"] == "assistant":
                assert m["content"] == greedy_reference(tiny, msgs[:k], 6)
    # the regenerated file is extraction input as it is
    assert extract_main(["--target", tiny, "--data", str(out), "--out", str(tmp_path / "shards"), "--layer-ids",
                         "1,2", "--no-progress"]) == 0
    m = read_manifest(tmp_path / "shards")
    assert m["totals"]["samples"] + sum(m["skipped"].values()) == 4


def test_a_later_turn_longer_than_the_cache_waits_for_a_larger_round(tiny, tmp_path):
    """Without --max-prompt-length the slot cache is sized for the first turns (at least 1024 tokens); a later
    turn that outgrows it is answered in a second round, with the same answer."""
    long_turn = " ".join(["alpha", "beta", "gamma", "delta"] * 300)  # > 1024 tokens
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": long_turn}]},
               {"messages": [{"role": "user", "content": "golf hotel"}]}]
    out = tmp_path / "out.jsonl"
    assert main(["--target", tiny, "--data", write_jsonl(tmp_path / "in.jsonl", records), "--out", str(out),
                 "--max-new-tokens", "3", "--batch-size", "2", "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    msgs = rows[0]["messages"]
    assert len(smollm2_tokenizer()(long_turn)["input_ids"]) > 1024
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[3]["content"] == greedy_reference(tiny, msgs[:3], 3)
    assert rows[1]["messages"][1]["content"] == greedy_reference(tiny, rows[1]["messages"][:1], 3)


def test_a_turn_over_max_prompt_length_ends_the_conversation_before_it(tiny, tmp_path, capsys):
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": " ".join(["alpha"] * 60)}]},
               {"messages": [{"role": "user", "content": " ".join(["beta"] * 60)}]}]
    out = tmp_path / "out.jsonl"
    assert main(["--target", tiny, "--data", write_jsonl(tmp_path / "in.jsonl", records), "--out", str(out),
                 "--max-new-tokens", "3", "--max-prompt-length", "40", "--batch-size", "2", "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0]  # the second has no turn short enough: skipped as too long
    msgs = rows[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[0]["content"] == "hi"
    assert msgs[1]["content"] == greedy_reference(tiny, msgs[:1], 3)
    err = capsys.readouterr().err
    assert "1 of them ended before a turn longer than --max-prompt-length" in err and "too_long" in err


def test_resume_drops_a_cut_line_and_completes(tiny, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS)
    flags = ["--target", tiny, "--data", data, "--max-new-tokens", "4", "--batch-size", "2", "--no-progress"]
    full = tmp_path / "full.jsonl"
    assert main([*flags, "--out", str(full)]) == 0
    part = tmp_path / "part.jsonl"
    assert main([*flags, "--out", str(part), "--limit", "2"]) == 0
    with open(part, "a") as f:
        f.write('{"index": 2, "source": "cut by a ki')  # the run died mid-line
    assert main([*flags, "--out", str(part)]) == 2  # an existing output needs --resume
    assert main([*flags, "--out", str(part), "--resume"]) == 0
    assert part.read_text() == full.read_text()


class _FakeServer(BaseHTTPRequestHandler):
    bodies = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append((self.path, body))
        type(self).auth = self.headers.get("Authorization")
        last = body["messages"][-1]["content"]
        msg = {"role": "assistant", "content": f"answer to {last}"}
        if body["model"] == "thinker":
            msg["reasoning_content"] = "thinking hard"
        reply = json.dumps({"choices": [{"message": msg}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _FakeServer.bodies.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_server_gets_one_request_per_turn(server, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS)
    out = tmp_path / "out.jsonl"
    assert main(["--server", server, "--model", "m", "--data", data, "--out", str(out), "--temperature", "0.7",
                 "--top-p", "0.9", "--max-new-tokens", "33", "--concurrency", "3", "--seed", "5",
                 "--chat-template-kwargs", '{"enable_thinking": false}', "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 4]
    assert rows[0]["messages"] == [{"role": "user", "content": "alpha beta"},
                                   {"role": "assistant", "content": "answer to alpha beta"},
                                   {"role": "user", "content": "gamma"},
                                   {"role": "assistant", "content": "answer to gamma"}]
    assert len(_FakeServer.bodies) == 5
    path, body = _FakeServer.bodies[0]
    assert path == "/v1/chat/completions"
    assert {k: body[k] for k in ("model", "temperature", "top_p", "max_tokens", "chat_template_kwargs")} == \
        {"model": "m", "temperature": 0.7, "top_p": 0.9, "max_tokens": 33,
         "chat_template_kwargs": {"enable_thinking": False}}
    second_turn = [b for _, b in _FakeServer.bodies if b["messages"][-1]["content"] == "gamma"][0]
    assert second_turn["messages"][1] == {"role": "assistant", "content": "answer to alpha beta"}
    think = tmp_path / "think.jsonl"
    assert main(["--server", server, "--model", "thinker", "--data", data, "--out", str(think), "--limit", "1",
                 "--api-key", "sk-test", "--no-progress"]) == 0
    assert _FakeServer.auth == "Bearer sk-test"
    answer = json.loads(think.read_text())["messages"][1]["content"]
    assert answer == "<think>\nthinking hard\n</think>\n\nanswer to alpha beta"


def test_unreachable_server_fails_with_the_url(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:1])
    assert main(["--server", "http://127.0.0.1:9/v1", "--model", "m", "--data", data, "--out",
                 str(tmp_path / "o.jsonl"), "--no-progress"]) == 2
    assert "http://127.0.0.1:9/v1/chat/completions" in capsys.readouterr().err


def test_sampling_is_seeded_and_limits_apply(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS)
    flags = ["--target", tiny, "--data", data, "--max-new-tokens", "6", "--no-progress", "--device", "cpu"]
    runs = []
    for name, extra in (("a", ["--seed", "3"]), ("b", ["--seed", "3"]), ("c", ["--seed", "4"])):
        out = tmp_path / f"{name}.jsonl"
        assert main([*flags, "--out", str(out), "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95",
                     *extra]) == 0
        runs.append(out.read_text())
    assert runs[0] == runs[1] != runs[2]  # same seed, same answers; another seed, others
    greedy = tmp_path / "g.jsonl"
    assert main([*flags, "--out", str(greedy), "--dtype", "bfloat16"]) == 0
    assert greedy.read_text() != runs[0]
    # prompts (with SmolLM2's default system prompt): record 0 turn 1: 32 tokens, turn 2: longer; 1: 20; 2: 32; 4: 39
    short = tmp_path / "short.jsonl"
    assert main([*flags, "--out", str(short), "--max-prompt-length", "35"]) == 0
    rows = [json.loads(line) for line in short.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]  # record 0 ends before its second turn; record 4 has no turn
    assert [m["role"] for m in rows[0]["messages"] if m["role"] != "system"] == ["user", "assistant"]
    err = capsys.readouterr().err
    assert "'too_long': 1" in err and "1 of them ended before a turn longer" in err
    assert main([*flags, "--out", str(tmp_path / "f.jsonl"), "--on-bad", "fail"]) == 2
    assert f"{data}:4: no_user_turn" in capsys.readouterr().err


def test_max_turns_answers_only_the_first_user_turns(server, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:1])
    out = tmp_path / "out.jsonl"
    assert main(["--server", server, "--model", "m", "--data", data, "--out", str(out), "--max-turns", "1",
                 "--no-progress"]) == 0
    row = json.loads(out.read_text())
    assert row["messages"] == [{"role": "user", "content": "alpha beta"},
                               {"role": "assistant", "content": "answer to alpha beta"}]
    assert len(_FakeServer.bodies) == 1


def test_a_chat_template_renders_regenerated_prompts_as_training_and_eval_do(tiny, tmp_path, capsys):
    """--chat-template reaches regeneration's prompts as it reaches extraction's, training's and eval's: the one
    renderer's prompt ids (extract/data/rendering.py); a server renders with its own template, so the flag is
    refused there."""
    from dflashkit.extract.data.rendering import ChatConfig, prompt_ids
    from dflashkit.extract.generation.answerers import AnswerSettings, TargetGenerator

    persona = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    kwargs = {"persona": "One line only."}
    history = [{"role": "user", "content": "Name a colour."}]
    gen = TargetGenerator(tiny, AnswerSettings(max_new_tokens=2, template_kwargs=kwargs), batch_size=16,
                          chat_template=persona, device="cpu", dtype="float32", cuda_graph=False)
    chat = ChatConfig(chat_template=persona, template_kwargs=kwargs)
    assert gen._prompt(history) == prompt_ids(gen.tok, history, chat) != prompt_ids(gen.tok, history, ChatConfig())
    assert gen.tok.decode(gen._prompt(history)).startswith("<|im_start|>system\nOne line only.")
    (tmp_path / "persona.jinja").write_text(persona)
    data = write_jsonl(tmp_path / "in.jsonl", REGENERATE_RECORDS[:1])
    assert main(["--server", "http://127.0.0.1:9/v1", "--model", "m", "--chat-template",
                 str(tmp_path / "persona.jinja"), "--data", data, "--out", str(tmp_path / "o.jsonl"),
                 "--no-progress"]) == 2
    assert "a server renders with its own template" in capsys.readouterr().err
