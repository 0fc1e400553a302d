"""The HTTP client of a running OpenAI-compatible server (vLLM, SGLang): its models, one streamed chat request, its
Prometheus metrics and the tau they give.

Design choices:
- Requests are streamed chat completions (`stream: true`, usage requested), so time to first token is the time
  to the first chunk carrying text, and output tokens come from the usage block (or, without one, the count of
  content chunks). A request that fails (HTTP error, timeout, broken stream, the server's error event) comes back
  as a ``RequestResult`` saying why, so a sweep counts it instead of stopping.
- tau comes from the server's Prometheus /metrics where it exposes one, read before and after a level:
  vLLM's counters give tau = 1 + delta(accepted tokens) / delta(drafts) for exactly that level's requests;
  SGLang's gauge `sglang:spec_accept_length` (a recent average) is read after the level.
- Only the standard library talks HTTP (urllib), so this runs where nothing else is installed.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from dflashkit.errors import UserError, shown

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"


@dataclass
class RequestResult:
    ok: bool  # a complete stream with at least one token
    output_tokens: int = 0  # from usage, else the number of content chunks
    ttft_s: float | None = None  # time to the first chunk with text
    latency_s: float = 0.0  # time to the end of the stream
    error: str | None = None  # why it failed


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over its label sets (text exposition format); gauges of averages
    (sglang:spec_accept_length, one per rank) are averaged instead."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    if SGLANG_ACCEPT_LENGTH in sums:
        sums[SGLANG_ACCEPT_LENGTH] /= counts[SGLANG_ACCEPT_LENGTH]
    return sums


def read_metrics(base_url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The server's /metrics (``parse_prometheus``); None when it exposes none or does not answer."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as response:
            return parse_prometheus(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tau_from_metrics(before: dict | None, after: dict | None) -> tuple[float | None, str | None]:
    """(tau, where it came from) or (None, None) when the server exposes no speculative metrics."""
    if before and after and VLLM_DRAFTS in after:
        drafts = after[VLLM_DRAFTS] - before.get(VLLM_DRAFTS, 0.0)
        if drafts > 0:
            return 1.0 + (after.get(VLLM_ACCEPTED, 0.0) - before.get(VLLM_ACCEPTED, 0.0)) / drafts, VLLM_ACCEPTED
    if after and SGLANG_ACCEPT_LENGTH in after:
        return after[SGLANG_ACCEPT_LENGTH], SGLANG_ACCEPT_LENGTH
    return None, None


def list_models(base_url: str, timeout: float = 10.0) -> list[str]:
    """The model ids the server lists (GET /v1/models). A server that cannot be reached, or that answers
    something other than ``{"data": [{"id": ...}, ...]}``, is a UserError naming the URL."""
    url = base_url.rstrip("/") + "/v1/models"
    fix = "is --server the base URL of an OpenAI-compatible server (vLLM, SGLang), e.g. http://localhost:8000?"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise UserError(f"{url}: HTTP {error.code} {error.reason}; {fix}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:  # refused, unknown host, timeout, bad URL
        raise UserError(f"{url}: no answer ({getattr(error, 'reason', error)}); start the server, or fix "
                        "--server (the base URL of a vLLM / SGLang server, e.g. http://localhost:8000)") from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{url}: the answer is not JSON ({error}); {fix}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise UserError(f'{url}: expected {{"data": [{{"id": MODEL}}, ...]}}, got {body[:80]!r}; {fix}')
    return [m["id"] for m in models]


def stream_chat(base_url: str, model: str, messages: list[dict], max_tokens: int, temperature: float,
                timeout: float) -> RequestResult:
    """One streamed chat completion, timed; an HTTP, network or stream failure is kept in ``error``, not raised."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    result = RequestResult(ok=False)
    chunks, usage_tokens, first = 0, None, None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                first = first or line
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = _stream_event(data)
                if isinstance(event.get("usage"), dict):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if isinstance(choice, dict) and (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - start
    except urllib.error.HTTPError as error:
        result.error = f"HTTP {error.code}: {error.read()[:200].decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.latency_s = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if result.error is None:
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream carried no tokens" + (f", it began {shown(first)}" if first else "")
    return result


def _stream_event(data: str) -> dict:
    """One server-sent event of a chat-completions stream; ValueError (the request fails, and is counted) for
    one that is not a JSON object or that carries the server's ``error``."""
    event = json.loads(data)
    if not isinstance(event, dict):
        raise ValueError(f"an event is not a JSON object: {shown(data)}")
    if event.get("error"):
        error = event["error"]
        said = error.get("message", error) if isinstance(error, dict) else error
        raise ValueError(f"the server sent an error: {shown(said)}")
    return event
