"""An OpenAI-compatible server started from a `vllm serve` command line, serving with the CPU twin of vllm.LLM.

The command is parsed with vLLM's flag names; a flag the twin does not know fails the start, so a report's serve
command that this server starts is complete for what it names. The server answers /v1/models, streamed
/v1/chat/completions (one request at a time through the twin, greedy), /metrics (the twin's spec-decode counters
under vLLM's Prometheus names) and, like vLLM's development mode, /server_info?config_format=json with the
configuration it was started with.
"""

import argparse
import json
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from transformers import AutoTokenizer

from . import vllm_standin


class CommandError(ValueError):
    pass


def parse_serve_command(command: str) -> argparse.Namespace:
    """`vllm serve TARGET [flags]` as vLLM names its flags; CommandError on anything else."""
    words = shlex.split(command.split("  #")[0])
    if words[:2] != ["vllm", "serve"]:
        raise CommandError(f"not a vllm serve command: {command!r}")
    parser = argparse.ArgumentParser(prog="vllm serve", add_help=False, exit_on_error=False)
    parser.add_argument("model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    try:
        args, unknown = parser.parse_known_args(words[2:])
    except argparse.ArgumentError as error:
        raise CommandError(str(error)) from None
    if unknown:
        raise CommandError(f"flags the server does not know: {unknown}")
    return args


class StandinServer:
    def __init__(self, command: str, server_info: bool = True):
        args = parse_serve_command(command)
        compilation = ({"max_cudagraph_capture_size": args.max_cudagraph_capture_size}
                       if args.max_cudagraph_capture_size else {})
        self.spec = args.speculative_config
        self.llm = vllm_standin.LLM(args.model, speculative_config=dict(self.spec) if self.spec else None,
                                    max_num_seqs=args.max_num_seqs, disable_log_stats=False,
                                    enable_prefix_caching=not args.no_enable_prefix_caching,
                                    enforce_eager=args.enforce_eager, dtype=args.dtype,
                                    max_model_len=args.max_model_len,
                                    **({"compilation_config": compilation} if compilation else {}))
        self.config = {"speculative_config": self.spec, "scheduler_config": {"max_num_seqs": args.max_num_seqs},
                       "compilation_config": {"max_cudagraph_capture_size": args.max_cudagraph_capture_size},
                       "model_config": {"max_model_len": args.max_model_len}} if server_info else None
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.lock = threading.Lock()  # the twin is not thread-safe: one generate at a time

    def generate(self, messages: list[dict], max_tokens: int) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        ids = self.tokenizer(text)["input_ids"]
        with self.lock:
            out = self.llm.generate([{"prompt_token_ids": ids}],
                                    vllm_standin.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return list(out[0].outputs[0].token_ids)

    def metrics(self) -> str:
        with self.lock:
            found = self.llm.get_metrics()
        return "".join(f"{m.name}_total {m.value}\n" for m in found if hasattr(m, "value"))


def _handler(server: StandinServer):
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
                self._send(200, json.dumps({"data": [{"id": "standin"}]}))
            elif self.path == "/metrics":
                self._send(200, server.metrics(), "text/plain")
            elif self.path == "/server_info?config_format=json" and server.config is not None:
                self._send(200, json.dumps({"vllm_config": server.config}))
            else:
                self._send(404, "{}")

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            tokens = server.generate(request["messages"], request["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for token in tokens:
                chunk = {"choices": [{"index": 0, "delta": {"content": f" t{token}"}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": len(tokens)}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return Handler


def start_standin_server(command: str, server_info: bool = True) -> tuple[ThreadingHTTPServer, str]:
    """(the HTTP server, its base URL) serving what ``command`` names; stop it with ``stop_standin_server``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(StandinServer(command, server_info)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stop_standin_server(httpd: ThreadingHTTPServer) -> None:
    httpd.shutdown()
    httpd.server_close()
