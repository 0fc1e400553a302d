"""The serving sweep against a local OpenAI-compatible server that decodes with a real (tiny, random) model.

The server runs our speculative engine on each request and exposes vLLM's spec-decode counters computed from
the rounds it really ran, so the tau the sweep reads back can be checked against the engine's own rounds.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.errors import UserError
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.server_client import parse_prometheus, tau_from_metrics
from dflashkit.eval.serving import (
    level_conversations,
    parse_servers,
    plan_from_servers,
    render_plan_markdown,
    run_server_plan,
    sweep,
)

from support.tiny_targets import VOCAB, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyServer:
    def __init__(self):
        torch.manual_seed(0)
        config = tiny_target_config()
        drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4,
                                                         mask_token_id=VOCAB - 1))
        self.decoder = SpeculativeDecoder(LlamaForCausalLM(config).eval(), drafter, DecodeConfig())
        self.lock = threading.Lock()  # one generation at a time: the decoder is not thread-safe
        self.count_lock = threading.Lock()  # separate, so that a waiting request still counts as in flight
        self.results = []  # GenerationResult per successful request, in completion order
        self.in_flight = self.max_in_flight = 0
        # From the 5th counted request on (the level with 3 in flight), the first one to arrive waits until a second is
        # in flight before generating: the overlap is then certain when the client really overlaps requests, and
        # the wait times out (and the test fails) when it does not. No outcome depends on thread timing.
        self.requests = 0
        self.overlap_seen = threading.Event()
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}

    def generate(self, text: str, max_tokens: int):
        prompt = [ord(c) % VOCAB for c in text][:16]
        with self.lock:
            self.decoder.config.max_new_tokens = max_tokens
            result = self.decoder.generate(prompt)
            self.results.append(result)
            self.counters["drafts"] += len(result.acceptance_lengths)
            self.counters["draft_tokens"] += sum(n - 1 for n in result.nodes_per_round)
            self.counters["accepted"] += sum(n - 1 for n in result.acceptance_lengths)
        return result.tokens

    def metrics(self) -> str:
        c = self.counters
        return ("# TYPE vllm:spec_decode_num_drafts counter\n"
                f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {c["drafts"]}.0\n'
                f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {c["draft_tokens"]}.0\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {c["accepted"]}.0\n')


def make_handler(server: TinyServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body, kind="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "tiny"}]}))
            elif self.path == "/metrics":
                self._send(200, server.metrics(), "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = request["messages"][-1]["content"]
            if "FAIL" in text:
                return self._send(400, json.dumps({"error": "refused by the test server"}))
            with server.count_lock:
                server.requests += 1
                gated = server.requests > 4  # 4 requests (FAIL is refused above) per level
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
                if gated and server.in_flight > 1:
                    server.overlap_seen.set()
            if gated:
                server.overlap_seen.wait(timeout=120)
            try:
                tokens = server.generate(text, request["max_tokens"])
            finally:
                with server.count_lock:
                    server.in_flight -= 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for token in tokens:
                chunk = {"choices": [{"index": 0, "delta": {"content": f" t{token}"}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"completion_tokens": len(tokens)}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return Handler


def start_server():
    tiny = TinyServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(tiny))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return tiny, httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stop_server(httpd):
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture()
def server():
    tiny, httpd, url = start_server()
    yield tiny, url
    stop_server(httpd)


def test_sweep_counts_tokens_failures_and_reads_tau(server):
    tiny, url = server
    conversations = [[{"role": "user", "content": text}] for text in
                     ("hello there", "what is two plus two", "FAIL please", "write a poem", "tell me more")]
    result = sweep(url, conversations, levels=[1, 3], max_tokens=12)
    assert result["model"] == "tiny"
    done = 0
    for level in result["levels"]:
        assert (level["successes"], level["failures"]) == (4, 1)
        assert "HTTP 400" in level["errors"][0]
        assert level["output_tokens"] == 4 * 12
        assert 0 < level["ttft_mean_s"] <= level["latency_mean_s"] and level["ttft_p99_s"] >= level["ttft_p50_s"]
        assert level["aggregate_tokens_per_s"] > 0 and level["per_request_tokens_per_s"] > 0
        rounds = [n for r in tiny.results[done:done + 4] for n in r.acceptance_lengths]
        assert level["tau"] == pytest.approx(sum(rounds) / len(rounds)) and level["tau_source"].startswith("vllm")
        done += 4
    assert tiny.max_in_flight > 1  # the second level really overlapped requests


def test_a_capped_level_sends_the_in_process_engines_requests(server):
    """--max-requests-per-level 2 --min-waves 2 at c = 2: two waves of 2 requests, the prompts taken in order as
    `--engine vllm` takes them (level_requests), so the third prompt (refused by the server) is among them."""
    tiny, url = server
    conversations = [[{"role": "user", "content": text}] for text in
                     ("hello there", "two plus two", "FAIL please", "a poem", "more")]
    assert level_conversations(conversations, 2) is conversations  # no cap, one wave: every prompt once
    assert level_conversations(conversations, 2, 2, 2) == conversations[:4]
    result = sweep(url, conversations, levels=[2], max_tokens=5, max_requests_per_level=2, min_waves=2)
    level = result["levels"][0]
    assert (level["requests"], level["successes"], level["failures"]) == (4, 3, 1)
    assert len(tiny.results) == 3 and level["output_tokens"] == 3 * 5
    assert (result["max_requests_per_level"], result["min_waves"]) == (2, 2)


def test_prometheus_parsing_for_both_servers():
    sglang = ('# HELP sglang:spec_accept_length accept length\n'
              'sglang:spec_accept_length{dp_rank="0",model_name="m",tp_rank="0"} 3.5\n'
              'sglang:spec_accept_length{dp_rank="1",model_name="m",tp_rank="0"} 2.5\n'
              'sglang:num_running_reqs{model_name="m"} 4\n')
    parsed = parse_prometheus(sglang)
    assert parsed["sglang:spec_accept_length"] == 3.0 and parsed["sglang:num_running_reqs"] == 4
    assert tau_from_metrics(None, parsed) == (3.0, "sglang:spec_accept_length")
    before = parse_prometheus("vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_accepted_tokens_total 25\n")
    after = parse_prometheus("vllm:spec_decode_num_drafts_total 30\nvllm:spec_decode_num_accepted_tokens_total 85\n")
    assert tau_from_metrics(before, after)[0] == pytest.approx(1 + 60 / 20)
    assert tau_from_metrics(parse_prometheus("up 1\n"), parse_prometheus("up 1\n")) == (None, None)


def test_several_servers_give_repeated_cells_and_a_schedule():
    """none= and k3= servers (here two of the same tiny server: the numbers are timing, the relations are not)."""
    started = [start_server(), start_server()]
    try:
        conversations = [[{"role": "user", "content": t}] for t in ("hello there", "two plus two", "a poem", "more")]
        servers = parse_servers([f"none={started[0][2]}", f"k3={started[1][2]}"])
        plan = run_server_plan(servers, conversations, levels=[2], repeats=2, max_tokens=6, temperature=0.0,
                               model=None, timeout=120)
    finally:
        for _, httpd, _ in started:
            stop_server(httpd)
    none, k3 = plan["engines"]["none"]["2"], plan["engines"]["k3"]["2"]
    assert len(none["runs_tokens_per_s"]) == len(k3["runs_tokens_per_s"]) == 2 and k3["failures"] == 0
    assert k3["speedup"] == pytest.approx(k3["output_tokens_per_s"] / none["output_tokens_per_s"])
    assert k3["tau"] is not None and none["tau"] is not None  # both tiny servers report spec-decode counters
    expected = 3 if k3["speedup"] > 1 + k3["noise"] else 0
    assert plan["schedule"]["num_speculative_tokens_per_batch_size"] == [[1, 2, expected]]


def test_the_plan_of_servers_follows_the_cells():
    def runs(*rates):
        return [{"output_tokens_per_s": r, "requests": 4, "ttft_mean_s": 0.1, "itl_mean_s": None,
                 "acceptance": None, "failures": 0} for r in rates]

    plan = plan_from_servers({"none": {1: runs(100, 102, 98), 8: runs(400, 400, 400)},
                              "k3": {1: runs(150, 151, 149), 8: runs(390, 395, 400)},
                              "k15": {1: runs(170, 160, 180), 8: runs(300, 300, 300)},
                              "ngram": {1: runs(110, 110, 110), 8: runs(380, 380, 380)}})
    assert plan["engines"]["k15"]["1"]["speedup"] == pytest.approx(1.7)
    assert plan["schedule"]["per_level"] == {"1": {"k": 15, "speedup": pytest.approx(1.7),
                                                   "noise": pytest.approx(20 / 170 + 4 / 100)}, "8": {"k": 0}}
    assert plan["schedule"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 15], [2, 8, 0]]
    # the plan: k3 is within its noise of none at 8 (0.99x, noise 0.025) and 1.5x at 1; k15 and ngram lose at 8
    assert plan["plan"]["plan"] == "k3" and plan["plan"]["never_losing"] == ["k3"]
    assert "Plan: **k3**" in render_plan_markdown({**plan, "servers": {}, "repeats": 3})


def test_server_lists_are_checked():
    assert parse_servers(["http://h:1"]) == {"server": "http://h:1"}
    for items, said in ((["k3=http://h:1"], "needs none=URL"), (["none=http://h:1", "ngram=http://h:2"], "kN=URL"),
                        (["none=http://h:1", "none=http://h:2"], "distinct names"), (["none=h:1", "k3=http://h:2"],
                                                                                     "NAME=URL")):
        with pytest.raises(UserError, match=said):
            parse_servers(items)
