"""The report of `dflashkit eval --engine vllm`, built from what eval/vllm_engine.py measured (nothing runs here).

Design choices:
- report.json opens with ``headline`` (eval/serving_verdict.py): the plan to deploy, its serve command and every
  engine's speedup per concurrency, all measured in vLLM; a reader's first number is the engine's.
- Every serve command is the engine's as measured (``serve_command``: speculative_config, max_num_seqs, CUDA-graph
  capture size, dtype, max_model_len), so `eval --server` can sweep a server started from it.
- The concurrency rows: τ, per-position acceptance and lossless agreement of every prompt once,
  and the concurrency rows, are the drafter's at the headline k (block_size - 1 when measured) against no
  speculation; every row's speed is the median of the level's repeats.
- `engines` holds every engine's cells (no speculation, the drafter at each k, the baselines, the schedule), each
  with its speedup and noise against no speculation at the same level (eval/serving_plan.py); `per_k` the τ,
  acceptance and lossless count of each k, and the τ the largest k's drafter gets from its first k positions
  (a causal-in-block drafter should get the same at k itself).
- The serve command is the plan's (eval/serving_plan.py ``pick_plan``: a fixed k, the schedule, a baseline, or
  plain `vllm serve`), with the max_num_seqs and CUDA-graph capture size the engines were measured with;
  schedule.json beside report.json holds the schedule to deploy (the revision of costly k = 0 levels when there
  is one, else the derived schedule), its own serve command and what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .serving_plan import (
    REVISED,
    SCHEDULE_FIELD,
    agreement,
    capture_size,
    cell,
    first_positions_tau,
    run_requests,
    schedule_spec,
    speedup,
)
from .serving_verdict import headline, plan_verdict, verdict


def serve_command(run, spec: dict | None) -> str:
    """The `vllm serve` line of an engine of the run, as it was measured: its speculative_config (none without
    speculation), max_num_seqs (the largest level), the CUDA-graph capture size, dtype and max_model_len, and the
    prefix cache or CUDA graphs turned off when they were. The target is the directory the engines were given: a
    copy without a GGUF quantization_config where the target had one (vLLM refuses the original: rule
    gguf_quantization_config)."""
    from dflashkit.drafter import vllm_rules as rules

    flags = ["--dtype", run.config.dtype, "--max-model-len", str(run.max_len)]
    flags += ["--no-enable-prefix-caching"] if run.config.prefix_caching[0] == "off" else []
    flags += ["--enforce-eager"] if run.config.enforce_eager else []
    return rules.vllm_serve_command(str(run.served_dir), run.drafter, run.dcfg.block_size, spec, max(run.levels),
                                    capture_size(run, spec), engine_flags=flags, speculate=spec is not None)


def cells(results: dict, name: str, levels: list[int]) -> dict[int, dict]:
    return {c: cell(results[name][c]) for c in levels}


def level_speedups(results: dict, name: str, levels: list[int]) -> dict[int, dict]:
    """level -> {speedup, noise} of engine ``name`` against no speculation."""
    base, mine = cells(results, "none", levels), cells(results, name, levels)
    return {c: speedup(mine[c], base[c]) for c in levels}


def engine_table(run, results: dict, specs: dict[str, dict | None]) -> dict:
    """name -> its speculative_config and, per level, its cell with speedup and noise against no speculation."""
    base = cells(results, "none", run.levels)
    table = {}
    for name, spec in specs.items():
        mine = cells(results, name, run.levels)
        table[name] = {"speculative_config": spec, "serve_command": serve_command(run, spec),
                       "max_num_seqs": max(run.levels), "max_cudagraph_capture_size": capture_size(run, spec),
                       "levels": {str(c): {**mine[c], **speedup(mine[c], base[c])} for c in run.levels}}
    return table


def per_k(run, results: dict) -> dict:
    """k -> τ, per-position acceptance and lossless count over every prompt once; and from the largest k's
    per-position acceptance, the τ of its first k positions."""
    names = [name for name, _ in run.prompts]
    largest = (results[f"k{run.ks[-1]}"]["all"]["acceptance"] or {}).get("per_position_acceptance", [])
    out = {}
    for k in run.ks:
        acc = results[f"k{k}"]["all"]["acceptance"] or {}
        lossless = agreement(names, results[f"k{k}"]["all"]["outputs"], results["none"]["all"]["outputs"])
        out[str(k)] = {"tau": acc.get("tau"), "per_position_acceptance": acc.get("per_position_acceptance", []),
                       "identical": f"{lossless['identical']}/{lossless['requests']}",
                       f"tau_first_{k}_positions_at_k{run.ks[-1]}": first_positions_tau(largest, k) if largest
                       else None}
    return out


def concurrency_rows(run, results: dict) -> list[dict]:
    """The headline k against no speculation per level (medians of the repeats; acceptance and lossless from
    the first repeat)."""
    rows, name = [], f"k{run.headline_k}"
    for c in run.levels:
        a, b = cell(results[name][c]), cell(results["none"][c])
        first, base = results[name][c][0], results["none"][c][0]
        names = [n for n, _ in run_requests(run, c)]
        rows.append({"concurrency": c, "requests": a["requests"], "drafter": a, "no_drafter": b,
                     **speedup(a, b), "tau": (first["acceptance"] or {}).get("tau"),
                     "acceptance": first["acceptance"],
                     "lossless": agreement(names, first["outputs"], base["outputs"])})
    return rows


def prefix_rows(run, results: dict, prefix_runs: dict) -> dict:
    if not run.turns:
        return {"skipped": "no dataset record has a second user turn (builtin:mtbench has)"}
    runs = {("drafter", run.config.prefix_caching[0]): results[f"k{run.headline_k}"].get("multi_turn"),
            ("no_drafter", run.config.prefix_caching[0]): results["none"].get("multi_turn"), **prefix_runs}
    out = {}
    for prefix in run.config.prefix_caching:
        a, b = runs.get(("drafter", prefix)), runs.get(("no_drafter", prefix))
        if a and b:
            out[prefix] = {"tau": (a["acceptance"] or {}).get("tau"), "acceptance": a["acceptance"],
                           "drafter_tokens_per_s": a["output_tokens_per_s"],
                           "no_drafter_tokens_per_s": b["output_tokens_per_s"],
                           "speedup": a["output_tokens_per_s"] / b["output_tokens_per_s"]
                           if b["output_tokens_per_s"] else 0.0,
                           "ttft_mean_s": {"drafter": a["ttft_mean_s"], "no_drafter": b["ttft_mean_s"]},
                           "requests": a["requests"]}
    return out


def schedule_runner_note(version: str) -> str:
    """Which model runner vLLM ``version`` serves a schedule on (drafter/vllm_rules.py rule "schedule_runner")."""
    from dflashkit.drafter import vllm_rules as rules

    what, where = rules.vllm_rule("schedule_runner", version)
    return (f"vLLM {rules.vllm_release(version)}: {what} ({where}); the fixed-k engines ran on the runner vLLM "
            f"picks")


def schedule_section(run, results: dict, schedule: dict, table: dict) -> dict:
    """The derived schedule and its serve command (the engine that measured it, a schedule of zeros included) and,
    when its engine ran, what it measured; the same for the revision of its costly k = 0 levels
    (serving_plan.revise_zero_ranges), under ``zero_k_ranges``."""
    out = {**schedule, **schedule_engine(run, results, schedule, table, "schedule"),
           "runner": schedule_runner_note(run.api.version)}
    revision = schedule.get("zero_k_ranges", {})
    if revision.get("schedule"):
        out["zero_k_ranges"] = {**revision, "schedule": {**revision["schedule"], **schedule_engine(
            run, results, revision["schedule"], table, REVISED)}}
    return out


def schedule_engine(run, results: dict, schedule: dict, table: dict, name: str) -> dict:
    """A schedule's speculative_config and serve command, and what its engine ``name`` measured when it ran."""
    spec = schedule_spec(run.drafter, schedule)
    out = {"speculative_config": spec, "serve_command": serve_command(run, spec)}
    if name in results:
        out["measured"] = {c: v["speedup"] for c, v in table[name]["levels"].items()}
        out["tau"] = (results[name]["all"]["acceptance"] or {}).get("tau")
    return out


def build_vllm_report(run, results: dict, schedule: dict, baselines: dict, skipped: dict, prefix_runs: dict,
                      args: dict, started: float) -> dict:
    """report.json's content (its verdicts included) from every engine's measurements; ``args`` the run's
    target, datasets, num_prompts and max_prompt_tokens as given."""
    specs = {"none": None, **{f"k{k}": {"method": "dflash", "model": run.drafter, "num_speculative_tokens": k}
                              for k in run.ks}, **baselines}
    if "schedule" in results:
        specs["schedule"] = schedule_spec(run.drafter, schedule)
    if REVISED in results:
        specs[REVISED] = schedule_spec(run.drafter, schedule["zero_k_ranges"]["schedule"])
    table = engine_table(run, results, specs)
    rows = concurrency_rows(run, results)
    head = results[f"k{run.headline_k}"]["all"]
    overall_acc = head["acceptance"]
    report = {
        "engine": "vllm", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {"mode": "vllm", **args, "drafter": run.drafter, **run.chat.record(),
                 "max_model_len": run.max_len, **vars(run.config)},
        "block_size": run.dcfg.block_size, "num_speculative_tokens": run.headline_k, "ks": run.ks,
        "serve_command_fixed_k": serve_command(run, specs[f"k{run.headline_k}"]),
        "versions": {"vllm": run.api.version, "python": sys.version.split()[0]},
        "target": {"path": str(run.target_dir), "served_dir": str(run.served_dir),
                   "gguf_quantization_config_stripped": run.stripped},
        "drafter": {"path": run.drafter, "block_size": run.dcfg.block_size, "causal": bool(run.dcfg.causal),
                    "target_layer_ids": list(run.dcfg.target_layer_ids), "mask_token_id": run.dcfg.mask_token_id,
                    "layer_types": list(run.dcfg.layer_types)},
        "warnings": run.notes, "prompts": len(run.prompts), "acceptance": overall_acc,
        "lossless": agreement([n for n, _ in run.prompts], head["outputs"], results["none"]["all"]["outputs"]),
        "all_prompts": {"drafter_tokens_per_s": head["output_tokens_per_s"],
                        "no_drafter_tokens_per_s": results["none"]["all"]["output_tokens_per_s"]},
        "concurrency": rows, "prefix_caching": prefix_rows(run, results, prefix_runs), "datasets": {},
        "overall": {"tau": (overall_acc or {}).get("tau", 1.0), "speedup": rows[0]["speedup"],
                    "per_position_acceptance": (overall_acc or {}).get("per_position_acceptance", [])},
        "per_k": per_k(run, results), "engines": table,
        "baselines": {**{n: {"speculative_config": spec} for n, spec in baselines.items()},
                      **{n: {"skipped": why} for n, why in skipped.items()}},
        "schedule": schedule_section(run, results, schedule, table),
        "timing": {**run.engine_s, "total": time.perf_counter() - started},
    }
    report["verdict"] = verdict(rows, run.headline_k + 1)
    report["plan_verdict"] = plan_verdict(report)
    plan = report["plan_verdict"]["plan"]
    report["serve_command"] = serve_command(run, None if plan == "none" else specs[plan])  # the plan's
    return {"headline": headline(report), **report}  # first in report.json: what to deploy, measured in vLLM


def deployable_schedule(report: dict) -> tuple[str, dict]:
    """(engine name, schedule) of the schedule a deployment takes: the revision of the costly k = 0 levels when
    there is one (the derived schedule measured a cost there), else the derived schedule."""
    revised = report["schedule"].get("zero_k_ranges", {}).get("schedule")
    return (REVISED, revised) if revised else ("schedule", report["schedule"])


def write_schedule(report: dict, out: str | Path) -> Path:
    """schedule.json in ``out``: the speculative_config a deployment passes to vLLM (``deployable_schedule``), the
    serve command of the engine that measured it, and what it measured."""
    from dflashkit.files import atomic_write

    name, schedule = deployable_schedule(report)
    data = {"engine": name, "speculative_config": schedule["speculative_config"],
            SCHEDULE_FIELD: schedule[SCHEDULE_FIELD], "serve_command": schedule["serve_command"],
            "per_level": schedule["per_level"], "measured_speedup": schedule.get("measured"),
            "rule": schedule["rule"], "runner": report["schedule"]["runner"],
            "zero_k_ranges": report["schedule"].get("zero_k_ranges", {}).get("costly_zero_levels", {}),
            "vllm": report["versions"]["vllm"], "target": report["target"]["path"],
            "drafter": report["drafter"]["path"]}
    path = Path(out) / "schedule.json"
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode())
    return path
