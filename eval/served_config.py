"""What a running vLLM server serves, read back, beside the `eval --engine vllm` report whose command started it.

`dflashkit eval --server none=URL k3=URL schedule=URL ... --engine-report DIR` sweeps servers started from the
serve commands of an in-process run's report (report.json's engines, schedule.json). This module reads back
what each server really serves and puts its cells beside the in-process engine of the same name.

Design choices:
- Read back from vLLM's `/server_info?config_format=json`, its development endpoint (served when the server
  runs with VLLM_SERVER_DEV_MODE=1): the engine's whole configuration as JSON, of which the sweep keeps the
  speculative_config, scheduler_config.max_num_seqs, compilation_config.max_cudagraph_capture_size and
  model_config.max_model_len. A server without it (SGLang, vLLM without dev mode) is reported as not read back,
  with the reason; its cells are still compared.
- A server named like an engine of the report (``none``, ``kN``, ``schedule``, ``schedule_revised``, a baseline)
  is checked against that engine's recorded serve settings: the speculative_config fields the engine was given
  (method, num_speculative_tokens, the schedule, n-gram's lookup sizes), max_num_seqs, and the CUDA-graph capture
  size where the engine set one. Each difference is named; the cells stay side by side either way, so a
  mismatch is visible, never hidden.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

SPEC_FIELDS = ("method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "prompt_lookup_min",
               "prompt_lookup_max")


def read_served(base_url: str, timeout: float = 10.0) -> dict:
    """{"read": True, speculative_config, max_num_seqs, max_cudagraph_capture_size, max_model_len} from the
    server's /server_info, or {"read": False, "why": ...}."""
    url = base_url.rstrip("/") + "/server_info?config_format=json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            config = json.loads(response.read()).get("vllm_config")
    except urllib.error.HTTPError as error:
        return {"read": False, "why": f"{url}: HTTP {error.code} (vLLM answers it with VLLM_SERVER_DEV_MODE=1)"}
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as error:
        return {"read": False, "why": f"{url}: {type(error).__name__}: {error}"}
    if not isinstance(config, dict):
        return {"read": False, "why": f"{url}: no vllm_config object in the answer"}
    spec = config.get("speculative_config")
    return {"read": True, "speculative_config": {k: spec.get(k) for k in SPEC_FIELDS if k in spec}
            if isinstance(spec, dict) else None,
            "max_num_seqs": (config.get("scheduler_config") or {}).get("max_num_seqs"),
            "max_cudagraph_capture_size": (config.get("compilation_config") or {}).get("max_cudagraph_capture_size"),
            "max_model_len": (config.get("model_config") or {}).get("max_model_len")}


def differences(served: dict, engine: dict) -> list[str]:
    """What the server serves unlike the report's engine (its speculative_config, max_num_seqs and CUDA-graph
    capture size), one phrase each; empty when it serves the same."""
    expected, got = engine.get("speculative_config"), served.get("speculative_config")
    if expected is None or got is None:
        found = [] if expected is None and got is None else [
            f"speculative_config {json.dumps(got)} where the engine had {json.dumps(expected)}"]
    else:
        found = [f"{k} {json.dumps(got.get(k))} where the engine had {json.dumps(expected[k])}"
                 for k in SPEC_FIELDS if k in expected and expected[k] is not None and got.get(k) != expected[k]]
    for field in ("max_num_seqs", "max_cudagraph_capture_size"):
        if engine.get(field) is not None and served.get(field) != engine[field]:
            found.append(f"{field} {served.get(field)} where the engine had {engine[field]}")
    return found


def beside_engine(plan: dict, engine_report: dict, served: dict[str, dict]) -> dict:
    """name -> for each server named like an engine of ``engine_report`` (report.json of `eval --engine vllm`):
    the engine's serve command, what the server serves (``served``, ``read_served``'s) and how it differs, and per
    level the server's cell beside the in-process engine's (tok/s, speedup against its own no speculation, τ)."""
    out = {}
    for name, levels in plan["engines"].items():
        engine = engine_report.get("engines", {}).get(name)
        if engine is None:
            continue
        read = served.get(name, {"read": False, "why": "not asked"})
        cells = {c: {"server_tokens_per_s": cell["output_tokens_per_s"],
                     "in_process_tokens_per_s": engine["levels"][c]["output_tokens_per_s"],
                     "server_speedup": cell.get("speedup"), "in_process_speedup": engine["levels"][c].get("speedup"),
                     "server_tau": cell.get("tau"), "in_process_tau": engine["levels"][c].get("tau")}
                 for c, cell in levels.items() if c in engine["levels"]}
        out[name] = {"serve_command": engine.get("serve_command"), "served": read,
                     "differences": differences(read, engine) if read["read"] else None, "levels": cells}
    return out


def render_beside(beside: dict, report_dir: str) -> list[str]:
    """serving.md's section: what each server serves against the report's engine, then the cells side by side."""
    lines = [f"## Servers beside the in-process engines of {report_dir}", ""]
    for name, entry in beside.items():
        served = entry["served"]
        if not served["read"]:
            state = f"not read back: {served['why']}"
        elif entry["differences"]:
            state = "serves otherwise than the report's engine: " + "; ".join(entry["differences"])
        else:
            spec = served["speculative_config"]
            state = (f"serves the report's engine: speculative_config `{json.dumps(spec)}`, max_num_seqs "
                     f"{served['max_num_seqs']}, max_cudagraph_capture_size {served['max_cudagraph_capture_size']}")
        lines += [f"- **{name}** ({state}); started with `{entry['serve_command']}`"]
    lines += ["", "| server | c | tok/s server | tok/s in-process | speedup server | speedup in-process | τ server | "
              "τ in-process |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in beside.items():
        for c, v in entry["levels"].items():
            lines.append(f"| {name} | {c} | " + " | ".join(
                "—" if v[k] is None else f"{v[k]:.2f}" for k in ("server_tokens_per_s", "in_process_tokens_per_s",
                                                                 "server_speedup", "in_process_speedup",
                                                                 "server_tau", "in_process_tau")) + " |")
    return lines + [""]
