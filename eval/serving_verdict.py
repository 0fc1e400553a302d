"""The verdict of a served run (`dflashkit eval --engine vllm`) in words, and its report.md and plots.

Design choices:
- Faster means a level's output tok/s with the drafter exceeds the same requests' without it (speedup > 1).
  The verdict names the largest concurrency up to which every level is faster, or says that none is.
- The τ a level would need is a model, said as one: a speculative step yields τ tokens where an autoregressive
  step yields one, so speedup_c ≈ τ_c · t_AR,c / t_spec,c, and the τ that would make speedup_c = 1 at the step
  times measured there is τ_c / speedup_c (it ignores that a different drafter changes the step time, and
  that τ cannot exceed num_speculative_tokens + 1).
- The plan's verdict comes first: what to deploy, chosen from what every engine measured (eval/serving_plan.py
  ``pick_plan``: a fixed k, the schedule, a baseline, or no speculation and up to which concurrency the best
  engine pays), what the derived schedule measured, and which engine is fastest at each level; then the
  headline k's verdict.
- report.md opens with the headline (``headline_lines``): the plan's verdict, its serve command, the schedule it
  deploys, then the speedup of every engine at every level (± noise) and the plot; then the headline k's verdict,
  the settings and warnings, acceptance, lossless agreement, the headline k's concurrency table, the schedule (and
  its revision), τ per k, and prefix caching. The console ends with the same headline (eval/__main__.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.drafter.vllm_rules import schedule_runner


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}×"


def verdict(rows: list[dict], max_tau: float | None = None) -> dict:
    """rows: per concurrency level (ascending), each with concurrency, speedup and tau (None without drafts)."""
    for row in rows:
        row["tau_needed"] = row["tau"] / row["speedup"] if row.get("tau") and row.get("speedup") else None
    faster = [r["concurrency"] for r in rows if r["speedup"] > 1]
    slower = [r for r in rows if r["speedup"] <= 1]
    up_to = None
    for r in rows:
        if r["speedup"] <= 1:
            break
        up_to = r["concurrency"]
    lo, hi = rows[0], rows[-1]
    span = f"{_x(lo['speedup'])} at concurrency {lo['concurrency']}"
    if len(rows) > 1:
        span += f" … {_x(hi['speedup'])} at {hi['concurrency']}"

    def needs(r) -> str:
        if r.get("tau_needed") is None:
            return f"at concurrency {r['concurrency']} no τ was measured"
        beyond = (f", more than a block allows ({max_tau:g})" if max_tau and r["tau_needed"] > max_tau else "")
        return (f"at concurrency {r['concurrency']} it would need τ ≈ {r['tau_needed']:.2f} (measured "
                f"{r['tau']:.2f}{beyond})")

    model = ("(model: speedup ≈ τ·t_AR/t_spec step at the step times measured at each level, so the τ needed "
             "for speedup 1 is τ/speedup)")
    if not faster:
        text = (f"Serving with the drafter is never faster on this target: speedup {span}. "
                f"To break even, {needs(lo)}; {needs(hi)} {model}.")
    elif not slower:
        text = f"Serving with the drafter is faster at every concurrency measured: speedup {span}."
    elif up_to is not None and all(r["speedup"] <= 1 for r in rows if r["concurrency"] > up_to):
        first_slow = slower[0]
        text = (f"Serving with the drafter is faster up to concurrency {up_to} and slower from concurrency "
                f"{first_slow['concurrency']} on: speedup {span}. To break even, {needs(first_slow)}"
                + (f"; {needs(hi)}" if hi is not first_slow else "") + f" {model}.")
    else:
        text = (f"Serving with the drafter is faster at concurrency {', '.join(map(str, faster))} and slower at "
                f"{', '.join(str(r['concurrency']) for r in slower)}: speedup {span}. To break even, "
                f"{needs(slower[0])} {model}.")
    return {"text": text, "faster_up_to": up_to, "faster_at": faster,
            "tau_needed": {str(r["concurrency"]): r["tau_needed"] for r in rows}}


def _label(name: str) -> str:
    return {"none": "no speculation", "schedule": "schedule", "ngram": "n-gram", "mtp": "MTP",
            "schedule_revised": "schedule, costly k = 0 levels revised",
            "v1": "no speculation, V1 runner, piecewise graphs"}.get(
        name, f"k = {name[1:]}" if name.startswith("k") else name)


def _speedups(levels: dict) -> str:
    return ", ".join(f"{_x(v['speedup'])} at {c}" for c, v in levels.items())


def plan_verdict(report: dict) -> dict:
    """The serving plan in words: what to deploy, chosen from what every engine measured (eval/serving_plan.py
    ``pick_plan``), what the derived schedule measured, and which engine wins at each level (the highest median
    tok/s: no speculation, the drafter at a fixed k, the schedule, a baseline)."""
    from .serving_plan import pick_plan

    schedule, engines = report["schedule"], report["engines"]
    levels = list(engines["none"]["levels"])
    winners = {c: max(engines, key=lambda n: engines[n]["levels"][c]["output_tokens_per_s"]) for c in levels}
    ranges = json.dumps(schedule["num_speculative_tokens_per_batch_size"])
    measured = schedule.get("measured")
    chosen = pick_plan(engines)
    plan = chosen["plan"]
    if plan == "none":
        text = "Serve without speculation: nothing measured here is as fast as no speculation at every concurrency."
        fastest, up_to = chosen["fastest_at_lowest"], chosen["fastest_pays_up_to"]
        if fastest and up_to:
            text += (f" Up to concurrency {up_to}, {_label(fastest)} pays "
                     f"({_speedups({c: v for c, v in engines[fastest]['levels'].items() if int(c) <= up_to})}).")
    elif plan in ("schedule", "schedule_revised"):
        served = json.dumps(engines[plan]["speculative_config"]["num_speculative_tokens_per_batch_size"])
        text = (f"Serve with the schedule {served} (schedule.json, serve command below): measured "
                f"{_speedups(engines[plan]['levels'])} against no speculation.")
    else:
        text = (f"Serve with {_label(plan)} (serve command below): measured {_speedups(engines[plan]['levels'])} "
                f"against no speculation, never slower beyond the noise.")
    if not any(k for *_, k in schedule["num_speculative_tokens_per_batch_size"]):
        text += " The derived schedule is k = 0 everywhere: no k beats no speculation by more than the noise."
    elif plan == "schedule_revised":
        text += f" The derived schedule {ranges} measured {_speedups(engines['schedule']['levels'])}: not deployed."
    elif plan != "schedule":
        text += (f" The derived schedule {ranges} measured "
                 + (f"{_speedups(engines['schedule']['levels'])}: not deployed." if measured
                    else "nothing (its engine did not run): not deployed."))
    text += zero_range_words(schedule, engines, report.get("versions", {}).get("vllm"))
    v1 = {c: v["speedup"] for c, v in engines["v1"]["levels"].items()} if "v1" in engines else None
    # vLLM 0.24 serves a schedule on its V1 runner, whose own cost then bounds what a schedule can get; 0.26 on
    # the default V2 runner (drafter/vllm_rules.py rule "schedule_runner")
    on_v1 = schedule_runner(report.get("versions", {}).get("vllm")) == "v1"
    if v1 and on_v1:
        text += (f" A schedule runs on vLLM's V1 model runner (piecewise CUDA graphs), which without speculation "
                 f"measured {_speedups(engines['v1']['levels'])} of the default runner: no schedule can beat "
                 f"its own runner's cost.")
    elif v1:
        text += (f" A schedule runs on vLLM's default (V2) model runner here; the V1 runner without speculation "
                 f"measured {_speedups(engines['v1']['levels'])} of it, a cost a schedule does not pay.")
    text += " Fastest per concurrency: " + ", ".join(f"{c}: {_label(w)}" for c, w in winners.items()) + "."
    return {"text": text, "plan": plan, "never_losing": chosen["never_losing"], "rule": chosen["rule"],
            "v1_runner": v1,
            "winners": winners, "schedule": schedule["num_speculative_tokens_per_batch_size"],
            "min_measured_speedup": min(measured.values()) if measured else None}


def zero_range_words(schedule: dict, engines: dict, version: str | None) -> str:
    """Where the derived schedule's k = 0 levels cost against no speculation and what the plan does there
    (eval/serving_plan.py ``revise_zero_ranges``); "" where none cost."""
    from dflashkit.drafter.vllm_rules import vllm_release, vllm_rule

    costly = schedule.get("zero_k_ranges", {}).get("costly_zero_levels", {})
    if not costly:
        return ""
    where = ", ".join(f"{c} ({_x(v['speedup'])} ±{v['noise']:.2f})" for c, v in costly.items())
    text = (f" Its k = 0 levels cost against no speculation at concurrency {where}: vLLM {vllm_release(version)} "
            f"still runs the drafter's query pass in a k = 0 range ({vllm_rule('zero_k_range', version)[1]}).")
    paying = {c: v["k_that_pays"] for c, v in costly.items() if v["k_that_pays"]}
    if paying:
        revised = schedule["zero_k_ranges"]["schedule"]["num_speculative_tokens_per_batch_size"]
        text += (" The revised schedule " + json.dumps(revised) + " takes there the smallest k never slower than no "
                 "speculation in its own cells (" + ", ".join(f"k = {k} at {c}" for c, k in paying.items()) + ")"
                 + (f", measured {_speedups(engines['schedule_revised']['levels'])}." if "schedule_revised" in engines
                    else "; its engine did not run."))
    losing = [c for c, v in costly.items() if not v["k_that_pays"]]
    if losing:
        text += f" At {', '.join(losing)} every k loses too: no speculation is the fastest there."
    return text


def _column(name: str) -> tuple:
    """The headline table's column order: each k, the schedules, the baselines a user would deploy, then v1."""
    order = {"schedule": 1, "schedule_revised": 2, "ngram": 3, "mtp": 4, "v1": 5}
    return (order.get(name, 0), int(name[1:]) if name[:1] == "k" and name[1:].isdigit() else 0, name)


def headline(report: dict) -> dict:
    """report.json's first field: the plan to deploy (its serve command; the schedule when the plan is one) and
    every engine's speedup per concurrency level, all measured in vLLM (``measured_in`` says how)."""
    engines, plan = report["engines"], report["plan_verdict"]["plan"]
    spec = engines[plan]["speculative_config"] if plan != "none" else None
    return {"measured_in": f"vLLM {report['versions'].get('vllm')}: output tok/s against no speculation, the same "
                           f"requests, median of {report['args'].get('repeats')} runs per cell",
            "plan": plan, "plan_label": _label(plan), "serve_command": report["serve_command"],
            "speculative_config": spec,
            "num_speculative_tokens_per_batch_size": (spec or {}).get("num_speculative_tokens_per_batch_size"),
            "no_speculation_tokens_per_s": {c: v["output_tokens_per_s"]
                                            for c, v in engines["none"]["levels"].items()},
            "speedup": {_label(n): {c: v["speedup"] for c, v in e["levels"].items()}
                        for n, e in engines.items() if n != "none"}}


def headline_lines(report: dict) -> list[str]:
    """report.md's first section: the plan in words, its serve command, the schedule it deploys, the speedup of
    every engine per concurrency (± noise) and the plot."""
    engines, head = report["engines"], report["headline"]
    levels = list(engines["none"]["levels"])
    names = sorted((n for n in engines if n != "none"), key=_column)
    rows = [[c, f"{engines['none']['levels'][c]['output_tokens_per_s']:.0f}"]
            + [f"{engines[n]['levels'][c]['speedup']:.2f}× ±{engines[n]['levels'][c]['noise']:.2f}" for n in names]
            for c in levels]
    parts = [f"# Served by vLLM {report['versions'].get('vllm')}: the plan", "",
             f"**{report['plan_verdict']['text']}**", "", "Serve command (the plan's, as measured):", "", "```",
             head["serve_command"], "```", ""]
    if head["num_speculative_tokens_per_batch_size"] is not None:
        parts += ["Schedule to deploy (num_speculative_tokens_per_batch_size, also in schedule.json): "
                  f"`{json.dumps(head['num_speculative_tokens_per_batch_size'])}`", ""]
    parts += [f"## Speedup per concurrency ({head['measured_in']}; ± the runs' noise)",
              _table(rows, ["concurrency", "no speculation, tok/s"] + [_label(n) for n in names]), "",
              "![speedup against concurrency](speedup_vs_concurrency.png)", ""]
    return parts


def _table(rows: list[list], header: list[str]) -> str:
    def cell(v):
        return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def _ms(seconds) -> float | None:
    return None if seconds is None else 1e3 * seconds


def render_vllm_markdown(report: dict) -> str:
    args, acc = report["args"], report.get("acceptance") or {}
    if "headline" in report:
        parts = headline_lines(report)
    else:  # a report from before the headline
        parts = ["# Served by vLLM: verdict", ""] + ([f"**{report['plan_verdict']['text']}**", ""]
                                                     if "plan_verdict" in report else [])
    parts += [f"At num_speculative_tokens {report['num_speculative_tokens']}: {report['verdict']['text']}", "",
             f"target `{report['target']['path']}`, drafter `{report['drafter']['path']}`, vLLM "
             f"{report['versions'].get('vllm')}, greedy, {args['max_new_tokens']} new tokens, {report['prompts']} "
             f"prompts ({', '.join(args['datasets'])}), block size {report['block_size']}, num_speculative_tokens "
             f"{report['num_speculative_tokens']} (block_size − 1 = {report['block_size'] - 1}), prefix caching "
             f"{args['prefix_caching'][0]} for the main run", ""]
    if report["target"].get("gguf_quantization_config_stripped"):
        parts += ["The target's config.json carries a GGUF quantization_config, which vLLM refuses: the engines were "
                  f"given a copy without it, `{report['target']['served_dir']}`, and the serve commands name it.", ""]
    parts += [f"- {w}" for w in report.get("warnings", [])] + ([""] if report.get("warnings") else [])
    parts += ["## Acceptance (vLLM's spec-decode counters; every prompt once, submitted together)",
              f"τ = {acc.get('tau', 1.0):.3f} over {acc.get('drafts', 0)} drafts", "",
              _table([[k + 1, v] for k, v in enumerate(acc.get("per_position_acceptance", []))],
                     ["draft position", "accepted"]), ""]
    loss = report["lossless"]
    parts += ["## Lossless (greedy outputs with vs without the drafter, every prompt once)",
              f"{loss['identical']} of {loss['requests']} requests identical.", ""]
    if loss["divergences"]:
        parts += [_table([[d["prompt"], d["token_index"], d["drafter_tokens"], d["baseline_tokens"]]
                          for d in loss["divergences"]], ["prompt", "first differing token", "tokens (drafter)",
                                                          "tokens (no drafter)"]), ""]
    rows = [[r["concurrency"], r["requests"], r["drafter"]["output_tokens_per_s"],
             r["no_drafter"]["output_tokens_per_s"], r["speedup"], _ms(r["drafter"]["ttft_mean_s"]),
             _ms(r["no_drafter"]["ttft_mean_s"]), _ms(r["drafter"]["itl_mean_s"]), _ms(r["no_drafter"]["itl_mean_s"]),
             r["tau"], r.get("tau_needed"), f"{r['lossless']['identical']}/{r['lossless']['requests']}"]
            for r in report["concurrency"]]
    parts += ["## Concurrency (c requests submitted together, in waves)",
              _table(rows, ["concurrency", "requests", "tok/s drafter", "tok/s no drafter", "speedup",
                            "TTFT ms drafter", "TTFT ms no drafter", "ITL ms drafter", "ITL ms no drafter", "τ",
                            "τ needed (model)", "identical"]), ""]
    parts += plan_sections(report)
    prefix = report["prefix_caching"]
    parts += ["## Prefix caching (multi-turn: turn 2 after the target's turn-1 answer)"]
    if "skipped" in prefix:
        parts += [f"Skipped: {prefix['skipped']}.", ""]
    else:
        parts += [_table([[k, v["requests"], v["tau"], v["drafter_tokens_per_s"], v["no_drafter_tokens_per_s"],
                           v["speedup"]] for k, v in prefix.items()],
                         ["prefix cache", "requests", "τ", "tok/s drafter", "tok/s no drafter", "speedup"]), ""]
    return "\n".join(parts)


def plan_sections(report: dict) -> list[str]:
    """Speedup against concurrency, one line per engine; the schedule; τ per k."""
    if "engines" not in report:
        return []
    engines, schedule = report["engines"], report["schedule"]
    levels = list(engines["none"]["levels"])
    repeats = report["args"].get("repeats")

    def cell(v: dict) -> str:
        return f"{v['speedup']:.2f}× ±{v['noise']:.2f}"

    rows = [[_label(n)] + [cell(e["levels"][c]) for c in levels] for n, e in engines.items() if n != "none"]
    rows += [[_label(n), f"skipped: {b['skipped']}"] + [""] * (len(levels) - 1)
             for n, b in report.get("baselines", {}).items() if "skipped" in b]
    rows.append(["no speculation, tok/s"] + [f"{engines['none']['levels'][c]['output_tokens_per_s']:.0f} "
                                             f"±{engines['none']['levels'][c]['spread']:.2f}" for c in levels])
    if "headline" in report:  # the engines' speedups lead the report: here only the baselines skipped
        parts = [f"- {_label(n)}: skipped: {b['skipped']}" for n, b in report.get("baselines", {}).items()
                 if "skipped" in b] + [""]
    else:
        parts = [f"## Speedup against no speculation (median of {repeats} runs per cell; ± the runs' noise)",
                 _table(rows, ["engine"] + [f"c = {c}" for c in levels]), ""]
    parts += ["## The schedule (vLLM's num_speculative_tokens_per_batch_size)",
              f"`{json.dumps(schedule['num_speculative_tokens_per_batch_size'])}` — {schedule['rule']}. "
              f"{schedule['runner']}.", "", f"Serve command: `{schedule['serve_command']}`", "",
              _table([[c, v["k"], v.get("speedup"), v.get("noise")] for c, v in schedule["per_level"].items()],
                     ["concurrency", "k chosen", "its speedup", "noise"]), ""]
    revised = schedule.get("zero_k_ranges", {}).get("schedule")
    if revised:
        parts += ["## The schedule with its costly k = 0 levels revised",
                  f"`{json.dumps(revised['num_speculative_tokens_per_batch_size'])}` — {revised['rule']}.", "",
                  f"Serve command: `{revised['serve_command']}`", "",
                  _table([[c, v["k"], v.get("speedup"), v.get("noise")] for c, v in revised["per_level"].items()],
                         ["concurrency", "k", "its fixed-k speedup", "noise"]), ""]
    largest = report["ks"][-1]
    parts += ["## τ per num_speculative_tokens (every prompt once)",
              _table([[k, v["tau"], v[f"tau_first_{k}_positions_at_k{largest}"], v["identical"]]
                      for k, v in report["per_k"].items()],
                     ["k", "τ", f"τ of the first k positions at k = {largest}", "identical"]), ""]
    return parts


def write_vllm_plots(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, path: Path) -> str:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path.name

    rows, written = report["concurrency"], []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    if "engines" in report:
        for name, engine in report["engines"].items():
            if name != "none":
                levels = [int(c) for c in engine["levels"]]
                ax.plot(levels, [v["speedup"] for v in engine["levels"].values()], marker="o", label=_label(name))
        ax.legend(fontsize=7)
    else:
        ax.plot([r["concurrency"] for r in rows], [r["speedup"] for r in rows], marker="o")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrency (requests submitted together)", ylabel="speedup (tok/s ratio)",
           title="vLLM: with / without the drafter")
    written.append(save(fig, out_dir / "speedup_vs_concurrency.png"))
    curve = (report.get("acceptance") or {}).get("per_position_acceptance", [])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(curve) + 1), curve, marker="o")
    ax.set(xlabel="draft position", ylabel="fraction of drafts accepted", ylim=(0, 1.02),
           title=f"vLLM τ = {report['overall']['tau']:.2f}")
    written.append(save(fig, out_dir / "per_position_acceptance.png"))
    return written
