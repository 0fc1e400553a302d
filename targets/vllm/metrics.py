"""What `dflashkit eval --engine vllm` reads of a running vLLM engine: its speculative counters, timed waves of
requests through ``api.VllmApi``'s clock, and each prompt alone (eval/vllm_engine.py's module notes say what
each measures).

- τ and per-position acceptance are deltas of vLLM's counters (`vllm:spec_decode_num_drafts`,
  `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`; LLM(disable_log_stats=False)) over the part
  measured: τ = 1 + accepted / drafts; position k's acceptance = accepted_per_pos[k] / drafts.
- Per prompt: a prompt's rounds are its drafts and its round tokens drafts + accepted (as the local engine's
  outputs.jsonl counts them, eval/report.py), the answer that run's.
"""

from __future__ import annotations

import statistics

DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's speculative counters now, summed over label sets: drafts, accepted tokens, accepted per position."""
    out = {"drafts": 0, "accepted": 0, "per_pos": []}
    for metric in llm.get_metrics():
        if metric.name == DRAFTS:
            out["drafts"] += int(metric.value)
        elif metric.name == ACCEPTED:
            out["accepted"] += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            values = list(metric.values)
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(values), values)]
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    """τ and per-position acceptance over the change between two `spec_counters` (None without drafts)."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - (before["per_pos"][k] if k < len(before["per_pos"]) else 0) for k, a in enumerate(after["per_pos"])]
    return {"tau": 1.0 + accepted / drafts, "drafts": drafts, "accepted_tokens": accepted,
            "per_position_acceptance": [a / drafts for a in per_pos]}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def timed_generate(llm, api, requests: list[tuple[str, list[int]]], wave: int, params) -> dict:
    """The requests in waves of `wave`; outputs, wall time, TTFT / ITL per request, τ over the waves."""
    before = spec_counters(llm)
    outputs, ttft, itl, wall = [], [], [], 0.0
    for start in range(0, len(requests), wave):
        batch = [{"prompt_token_ids": ids} for _, ids in requests[start:start + wave]]
        t0 = api.clock()
        results = llm.generate(batch, params, use_tqdm=False)
        wall += api.clock() - t0
        for r in results:
            tokens = list(r.outputs[0].token_ids)
            outputs.append(tokens)
            m = getattr(r, "metrics", None)
            ttft.append(getattr(m, "first_token_latency", None) if m is not None else None)
            itl.append((m.last_token_ts - m.first_token_ts) / (len(tokens) - 1)
                       if m is not None and len(tokens) > 1 and m.last_token_ts > m.first_token_ts else None)
    tokens = sum(map(len, outputs))
    decode = [(i or 0.0) * (len(o) - 1) for i, o in zip(itl, outputs)]  # per request: last - first token time
    return {"outputs": outputs, "requests": len(requests), "output_tokens": tokens, "wall_s": wall,
            "decode_s_sum": sum(decode), "decode_tokens": sum(max(len(o) - 1, 0) for o in outputs),
            "output_tokens_per_s": tokens / wall if wall > 0 else 0.0, "ttft_mean_s": _mean(ttft),
            "ttft_p50_s": statistics.median([t for t in ttft if t is not None]) if any(t is not None for t in ttft)
            else None, "itl_mean_s": _mean(itl), "acceptance": acceptance(before, spec_counters(llm))}


def per_prompt_records(llm, keys: list[tuple[str, str]], prompts: list[tuple[str, list[int]]], params) -> list[dict]:
    """Every prompt alone on ``llm``: outputs.jsonl's records (eval/report.py), τ from the counters around each;
    ``keys``: each prompt's (dataset spec, prompt id)."""
    records = []
    for (spec, prompt_id), (_, ids) in zip(keys, prompts):
        before = spec_counters(llm)
        (result,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        after = spec_counters(llm)
        drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
        records.append({"dataset": spec, "id": prompt_id, "prompt_tokens": len(ids), "rounds": drafts,
                        "round_tokens": drafts + accepted, "tau": 1.0 + accepted / drafts if drafts else 0.0,
                        "tokens": list(result.outputs[0].token_ids)})
    return records


def per_prompt_summary(records: list[dict]) -> dict:
    """The report's ``per_prompt``: the prompts sent alone and their τ together."""
    rounds = sum(r["rounds"] for r in records)
    return {"prompts": len(records), "rounds": rounds, "file": "outputs.jsonl",
            "tau": sum(r["round_tokens"] for r in records) / rounds if rounds else None}
