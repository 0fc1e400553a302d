"""Serving benchmark: sweep concurrency against an OpenAI-compatible server (vLLM, SGLang) and read its tau.

Design choices:
- Each level sends the same prompts with `concurrency` requests in flight, each a streamed chat completion
  (eval/server_client.py: the HTTP client, TTFT and output tokens per request, tau from /metrics read before
  and after the level).
- Per level: successes and failures (HTTP errors, timeouts, broken streams; the first few messages kept),
  aggregate output tok/s (all tokens / wall time of the level), per-request tok/s (tokens / time after the
  first token), TTFT and latency percentiles.
- Several servers (`--server none=URL k3=URL k15=URL ngram=URL ...`): each is swept `--repeats` times, one server
  at a time, and its levels become cells as `--engine vllm`'s (eval/serving_plan.py: median tok/s and spread,
  speedup and noise against `none`, the server without speculation); the `kN` servers (the drafter served with
  num_speculative_tokens N) give the per-batch-size schedule, written to schedule.json. A server started with
  that schedule can then be swept under its own name (`schedule=URL`) to measure it.
- What each server serves is read back (eval/served_config.py, vLLM's /server_info); with `--engine-report DIR`
  (an `eval --engine vllm` report whose serve commands started the servers) each server is checked against the
  engine of its name and its cells are put beside that engine's.
- `--max-requests-per-level` / `--min-waves` give every level the requests `--engine vllm` gives it (the first
  cap prompts cycled to fill at least that many whole waves of c, eval/serving_plan.py `level_requests`), so a
  live server's table is comparable cell for cell with the in-process engine's; without them every level sends
  each prompt once.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflashkit.errors import UserError, shown
from dflashkit.files import atomic_write

from .options import EvalOptions
from .server_client import list_models, read_metrics, stream_chat, tau_from_metrics


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_level(base_url: str, model: str, conversations: list[list[dict]], concurrency: int, max_tokens: int,
              temperature: float, timeout: float) -> dict:
    before = read_metrics(base_url)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda m: stream_chat(base_url, model, m, max_tokens, temperature, timeout),
                                conversations))
    wall = time.perf_counter() - start
    tau, tau_source = tau_from_metrics(before, read_metrics(base_url))
    good = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    per_request = [(r.output_tokens - 1) / (r.latency_s - r.ttft_s) for r in good
                   if r.ttft_s is not None and r.output_tokens > 1 and r.latency_s > r.ttft_s]
    return {
        "concurrency": concurrency, "requests": len(results), "successes": len(good),
        "failures": len(results) - len(good), "errors": [r.error for r in results if not r.ok][:5],
        "wall_s": wall, "output_tokens": sum(r.output_tokens for r in good),
        "aggregate_tokens_per_s": sum(r.output_tokens for r in good) / wall if wall else 0.0,
        "per_request_tokens_per_s": statistics.mean(per_request) if per_request else None,
        "ttft_mean_s": statistics.mean(ttfts) if ttfts else None, "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "latency_mean_s": statistics.mean(r.latency_s for r in good) if good else None,
        "tau": tau, "tau_source": tau_source,
    }


def level_conversations(conversations: list[list[dict]], concurrency: int, cap: int | None = None,
                        min_waves: int = 1) -> list[list[dict]]:
    """The requests of one level: every conversation once, or with a cap or min_waves > 1 the in-process
    engine's rule (the first cap conversations cycled to fill at least min_waves whole waves)."""
    if cap is None and min_waves <= 1:
        return conversations
    from .serving_plan import level_requests

    return level_requests(conversations, concurrency, cap, min_waves)


def sweep(base_url: str, conversations: list[list[dict]], levels: list[int], max_tokens: int,
          temperature: float = 0.0, model: str | None = None, timeout: float = 300.0, progress=None,
          max_requests_per_level: int | None = None, min_waves: int = 1) -> dict:
    models = list_models(base_url)  # asked first: an unreachable or foreign server stops here, in one line
    if not model and not models:
        raise UserError(f"{base_url.rstrip('/')}/v1/models lists no model; pass --model NAME")
    model = model or models[0]
    out = {"server": base_url, "model": model, "max_tokens": max_tokens, "temperature": temperature,
           "prompts": len(conversations), "max_requests_per_level": max_requests_per_level,
           "min_waves": min_waves, "levels": []}
    for level in levels:
        requests = level_conversations(conversations, level, max_requests_per_level, min_waves)
        out["levels"].append(run_level(base_url, model, requests, level, max_tokens, temperature, timeout))
        if progress is not None:
            progress(out["levels"][-1])
    check_some_answered(base_url, out)
    return out


def check_some_answered(base_url: str, result: dict) -> None:
    """UserError naming the counts when no request of any level came back with tokens: nothing to measure, so no
    report is written."""
    sent = sum(level["requests"] for level in result["levels"])
    if sent and not any(level["successes"] for level in result["levels"]):
        said = result["levels"][0]["errors"][0]
        raise UserError(f"{base_url.rstrip('/')}/v1/chat/completions: 0 of {sent} requests came back with tokens "
                        f"(model {result['model']!r}; the first: {shown(said, 200)}); check --model against the "
                        f"server's /v1/models and that the server streams chat completions; no report written")


def render_markdown(result: dict) -> str:
    header = ["concurrency", "ok", "failed", "aggregate tok/s", "per-request tok/s", "TTFT p50 s", "TTFT p99 s",
              "τ"]
    lines = [f"# Serving sweep: {result['model']} at {result['server']}",
             f"{result['prompts']} prompts per level, max_tokens {result['max_tokens']}, "
             f"temperature {result['temperature']}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level in result["levels"]:
        cells = [level["concurrency"], level["successes"], level["failures"], level["aggregate_tokens_per_s"],
                 level["per_request_tokens_per_s"], level["ttft_p50_s"], level["ttft_p99_s"], level["tau"]]
        lines.append("| " + " | ".join("—" if c is None else f"{c:.3f}" if isinstance(c, float) else str(c)
                                       for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run_sweep(opts: EvalOptions) -> dict:
    """`dflashkit eval --server URL`: prompts from ``opts.dataset``, results in ``opts.out`` (serving.json,
    serving.md); with NAME=URL pairs the serving plan of every server (serving.json, serving.md, schedule.json),
    what each serves read back and, with ``opts.engine_report`` (an `eval --engine vllm` report directory), each
    server beside the in-process engine of its name (eval/served_config.py). Reads the --server flags of ``opts``
    (eval/options.py): concurrency (default 1 2 4 8 16 32), max_new_tokens, temperature, model, timeout, repeats
    (default 1), max_requests_per_level, min_waves (default 1)."""
    server = opts.server
    servers = parse_servers([server] if isinstance(server, str) else list(server),
                            need_k=opts.engine_report is None)
    report = engine_report_of(opts.engine_report, servers)
    conversations = sweep_conversations(opts.dataset, opts.num_prompts)
    levels = opts.concurrency or [1, 2, 4, 8, 16, 32]
    if "none" in servers:
        from .served_config import beside_engine, read_served

        plan = run_server_plan(servers, conversations, levels, opts.repeats or 1, opts.max_new_tokens,
                               opts.temperature, opts.model, opts.timeout, opts.max_requests_per_level,
                               opts.min_waves or 1)
        plan["served"] = {name: read_served(url) for name, url in servers.items()}
        if report is not None:
            plan["engine_report"] = str(opts.engine_report)
            plan["beside_engine"] = beside_engine(plan, report, plan["served"])
        return write_plan(plan, opts.out)
    result = sweep(servers["server"], conversations, levels, opts.max_new_tokens, opts.temperature, opts.model,
                   opts.timeout, progress=lambda level: print(
                       f"concurrency {level['concurrency']}: {level['successes']} ok, {level['failures']} failed, "
                       f"{level['aggregate_tokens_per_s']:.1f} tok/s, tau {level['tau']}"),
                   max_requests_per_level=opts.max_requests_per_level, min_waves=opts.min_waves or 1)
    return write_sweep(result, opts.out)


def sweep_conversations(datasets: list[str], num_prompts: int) -> list[list[dict]]:
    """The opening turns of the first ``num_prompts`` records of each dataset that training would take."""
    from dflashkit.extract.data.rendering import BadSample
    from dflashkit.extract.data.sources import iter_records

    from .prompts import opening_turns

    conversations = []
    for spec in datasets:
        taken = 0
        for item in iter_records(spec):
            if taken >= num_prompts:
                break
            try:
                if item.record is not None:
                    conversations.append(opening_turns(item.record, item.where))
                    taken += 1
            except BadSample:  # a record training skips for its turns (eval/prompts.py)
                continue
    return conversations


def write_sweep(result: dict, out: str | Path | None) -> dict:
    """One server's sweep: serving.json and serving.md in ``out`` (none: printed only)."""
    result["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "serving.json", (json.dumps(result, indent=2) + "\n").encode())
        atomic_write(out / "serving.md", render_markdown(result).encode())
    print(render_markdown(result))
    return result


# ----------------------------------------------------------------------------- several servers: the serving plan
def engine_report_of(path: str | Path | None, servers: dict[str, str]) -> dict | None:
    """The `eval --engine vllm` report.json of ``--engine-report`` (None without one), read before any request;
    UserError when it is not one, or when the servers are not NAME=URL pairs to set beside its engines."""
    if path is None:
        return None
    from .compare import read_report

    if "none" not in servers:
        raise UserError("--engine-report needs NAME=URL servers named like the report's engines (none=URL, kN=URL, "
                        "schedule=URL ...), so that each server's cells go beside its engine's")
    report = read_report(path)
    if report.get("engine") != "vllm" or not isinstance(report.get("engines"), dict):
        raise UserError(f"--engine-report {path}: not a report of `dflashkit eval --engine vllm` (no engines in its "
                        "report.json); give the --out of such a run")
    return report


def parse_servers(items: list[str], need_k: bool = True) -> dict[str, str]:
    """``--server`` values: one URL, or NAME=URL pairs (``none`` = no speculation, ``kN`` = the drafter at N
    speculative tokens, any other name a baseline or a schedule), with a ``kN`` to derive a schedule from unless
    not ``need_k`` (servers set beside an engine report); UserError naming the item otherwise."""
    import re

    if len(items) == 1 and "=" not in items[0]:
        return {"server": items[0]}
    servers = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")) or name in servers:
            raise UserError(f"--server {item!r}: give one URL, or NAME=URL pairs with distinct names (none=URL for "
                            "the server without speculation, kN=URL for the drafter at N speculative tokens)")
        servers[name] = url
    if "none" not in servers:
        raise UserError("--server with several servers needs none=URL: the server without speculation that every "
                        "speedup is measured against")
    if need_k and not any(re.fullmatch(r"k[1-9][0-9]*", n) for n in servers):
        raise UserError("--server with several servers needs at least one kN=URL (the drafter served with "
                        "num_speculative_tokens N) to derive a schedule from")
    return servers


def level_as_run(level: dict) -> dict:
    """One level of ``sweep`` in the shape eval/serving_plan.cell reads."""
    per_request = level.get("per_request_tokens_per_s")
    return {"output_tokens_per_s": level["aggregate_tokens_per_s"], "requests": level["requests"],
            "ttft_mean_s": level["ttft_mean_s"], "itl_mean_s": 1.0 / per_request if per_request else None,
            "acceptance": {"tau": level["tau"]} if level.get("tau") is not None else None,
            "failures": level["failures"]}


def plan_from_servers(runs: dict[str, dict[int, list[dict]]]) -> dict:
    """name -> level -> the repeats' runs (``level_as_run``) into cells, speedups against ``none``, the
    schedule of the ``kN`` servers and the plan to deploy (eval/serving_plan.py ``pick_plan``: the server never
    slower than ``none`` beyond the noise and fastest at the lowest level, else ``none``)."""
    from .serving_plan import cell, derive_schedule, pick_plan, speedup

    cells = {name: {c: cell(rs) for c, rs in per_level.items()} for name, per_level in runs.items()}
    table = {name: {str(c): {**v, **speedup(v, cells["none"][c]),
                             "failures": sum(r["failures"] for r in runs[name][c])} for c, v in per_level.items()}
             for name, per_level in cells.items()}
    ks = {int(name[1:]): name for name in runs if name[:1] == "k" and name[1:].isdigit()}
    schedule = derive_schedule({k: {int(c): v for c, v in table[name].items()} for k, name in ks.items()}) if ks \
        else None  # servers beside an engine report need no kN
    return {"engines": table, "schedule": schedule, "plan": pick_plan({n: {"levels": lv} for n, lv in table.items()})}


def run_server_plan(servers: dict[str, str], conversations: list[list[dict]], levels: list[int], repeats: int,
                    max_tokens: int, temperature: float, model: str | None, timeout: float,
                    max_requests_per_level: int | None = None, min_waves: int = 1) -> dict:
    """Every server swept ``repeats`` times over the same requests, one server at a time."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for name, url in servers.items():
        runs[name] = {c: [] for c in levels}
        for repeat in range(repeats):
            result = sweep(url, conversations, levels, max_tokens, temperature, model, timeout,
                           max_requests_per_level=max_requests_per_level, min_waves=min_waves)
            for level in result["levels"]:
                runs[name][level["concurrency"]].append(level_as_run(level))
            print(f"{name} ({url}) run {repeat + 1}/{repeats}: " + ", ".join(
                f"c{lv['concurrency']} {lv['aggregate_tokens_per_s']:.0f} tok/s" for lv in result["levels"]))
    return {"servers": servers, "repeats": repeats, "prompts": len(conversations), "max_tokens": max_tokens,
            "max_requests_per_level": max_requests_per_level, "min_waves": min_waves, **plan_from_servers(runs)}


def render_plan_markdown(plan: dict) -> str:
    levels = list(plan["engines"]["none"])
    schedule = plan["schedule"]
    lines = [f"# Serving plan from {len(plan['servers'])} servers", "",
             f"Schedule (num_speculative_tokens_per_batch_size): "
             f"`{json.dumps(schedule['num_speculative_tokens_per_batch_size'])}` — {schedule['rule']}" if schedule
             else "No schedule: no kN server to derive one from.",
             "", f"Plan: **{plan['plan']['plan']}** — {plan['plan']['rule']}", "",
             f"Speedup against `none` (median of {plan['repeats']} runs per cell, ± noise)", "",
             "| server | " + " | ".join(f"c = {c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, per_level in plan["engines"].items():
        if name != "none":
            lines.append(f"| {name} | " + " | ".join(f"{v['speedup']:.2f}× ±{v['noise']:.2f}"
                                                    for v in per_level.values()) + " |")
    lines.append("| none, tok/s | " + " | ".join(f"{v['output_tokens_per_s']:.0f}"
                                                  for v in plan["engines"]["none"].values()) + " |")
    if "beside_engine" in plan:
        from .served_config import render_beside

        lines += [""] + render_beside(plan["beside_engine"], plan["engine_report"])
    elif "served" in plan:
        lines += ["", "What each server serves (its /server_info):"] + [
            f"- {name}: " + (f"speculative_config `{json.dumps(v['speculative_config'])}`, max_num_seqs "
                             f"{v['max_num_seqs']}" if v["read"] else f"not read back: {v['why']}")
            for name, v in plan["served"].items()]
    return "\n".join(lines) + "\n"


def write_plan(plan: dict, out: str | Path | None) -> dict:
    plan["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    text = render_plan_markdown(plan)
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "serving.json", (json.dumps(plan, indent=2) + "\n").encode())
        atomic_write(out / "serving.md", text.encode())
        if plan["schedule"] is not None:
            atomic_write(out / "schedule.json", (json.dumps(plan["schedule"], indent=2) + "\n").encode())
    print(text)
    return plan
