"""The serving plan of `dflashkit eval --engine vllm`: measured cells, the per-batch-size schedule, baselines.

Pure functions over what the vLLM adapter (eval/vllm_engine.py) measured; nothing here runs an engine.

Design choices:
- A cell is one engine at one concurrency level, run ``repeats`` times over the same requests: its output tok/s
  is the median of the runs and its spread (max − min) / median. A speedup is the ratio of two cells' medians;
  its noise is the sum of the two spreads (a bound on how far the ratio moved between repeats).
- The schedule: at each measured level the k with the highest speedup among those that beat no speculation by
  more than the noise (speedup > 1 + noise), else 0. Batch sizes between two measured levels take the smaller
  of the two levels' k (what was measured on both sides), below the first level the first level's k; the last
  range ends at the largest level (the engines' max_num_seqs). Equal neighbours merge. The format is vLLM
  0.24's `speculative_config.num_speculative_tokens_per_batch_size`: `[first, last, k]` ranges, inclusive, from
  batch size 1 (vllm/config/speculative.py:161-167, validated at scheduler start by
  vllm/v1/spec_decode/dynamic/utils.py:7-74); vLLM's scheduler looks the k up by the number of requests of each
  step (v1/core/sched/scheduler.py:1054-1057) and caps it at `num_speculative_tokens`, so the schedule's engine
  is configured with the largest k of the schedule.
- Serving a schedule changes the engine: vLLM 0.24 runs it on the V1 model runner (config/vllm.py:2034-2035:
  the V2 runner lists dynamic speculative decoding as unsupported) with piecewise CUDA graphs
  (config/vllm.py:758-773), and the V1 DFlash proposer drafts exactly the step's k with 1 + k queries
  (v1/spec_decode/llm_base_proposer.py:463), at k = 0 still one query (:538-547). So a drafter served with a
  schedule must propose well at every k it names: a causal-in-block drafter (dflash_config.causal) proposes the
  same first j tokens for every k >= j; a non-causal one changes its proposals with k. The schedule's engine is
  measured like the others, so what the schedule costs is in its cells. vLLM 0.26 serves a schedule on its
  default V2 runner instead, drafting N and keeping the first k, a k = 0 range included (drafter/vllm_rules.py rules
  "schedule_runner", "zero_k_range").
- The plan to deploy is chosen from what was measured, not from what the cells predict (``pick_plan``): among
  every engine that speculates (the drafter at each fixed k, the schedule's own engine, the baselines), those
  never slower than no speculation beyond the noise at any level; of these the fastest at the lowest level.
  None qualifying, the plan is no speculation, and the verdict says up to which concurrency the engine fastest
  at the lowest level pays. On vLLM 0.24 the schedule's engine pays for its runner: measured on the H200
  testbed, 0.18x at one request where the schedule says k = 0, so the derived schedule is only
  deployed when its own measurement says so.
- A k = 0 range is not free: vLLM (0.24 and 0.26, until 0.33) still runs the drafter's query pass there (rule
  "zero_k_range"), so where the schedule's own engine measured a k = 0 level slower than no speculation beyond
  the noise, the plan gives that level the smallest fixed k never slower than no speculation there
  (``revise_zero_ranges``) and serves that revised schedule too; a level where every k loses keeps k = 0 and the
  verdict names its cost.
- Baselines a user would deploy instead: vLLM's n-gram prompt lookup (k 4, n 2…4) and the target's own MTP head
  when its config.json declares MTP layers (``num_nextn_predict_layers`` or ``mtp_num_hidden_layers``, as
  vllm/config/speculative.py reads them for the targets it knows). And ``v1``: no speculation on vLLM's V1 model
  runner (``VLLM_USE_V2_MODEL_RUNNER=0``, vllm/config/vllm.py:522-525) with piecewise CUDA graphs only, the way a
  schedule is served, so that the schedule's cost splits into the runner's and the drafter's; never a plan.
"""

from __future__ import annotations

import statistics

from dflashkit.errors import UserError

SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
BASELINES = ("ngram", "mtp", "v1")
V1_RUNNER = "v1"  # the baseline without speculation on vLLM's V1 model runner, the runner a schedule is served on
REVISED = "schedule_revised"  # the schedule whose costly k = 0 levels take the smallest k that pays (measured too)


# ----------------------------------------------------------------------------- requests and agreement
def level_requests(prompts: list[tuple[str, list[int]]], concurrency: int, cap: int | None = None,
                   min_waves: int = 1) -> list[tuple[str, list[int]]]:
    """The first `cap` prompts (all when None) in order, cycled to fill whole waves of `concurrency`, at least
    `min_waves` of them."""
    waves = max(-(-min(len(prompts), cap or len(prompts)) // concurrency), min_waves)
    total = waves * concurrency
    return [prompts[k % len(prompts)] for k in range(total)]


def run_requests(run, c: int) -> list[tuple[str, list[int]]]:
    """The requests of level ``c``: the same for every engine of the run."""
    return level_requests(run.prompts, c, run.config.max_requests_per_level, run.config.min_waves)


def agreement(names: list[str], with_drafter: list[list[int]], without: list[list[int]]) -> dict:
    """Greedy outputs with and without the drafter, request by request: identical count, first divergences."""
    from .lossless import first_divergence

    divergences = []
    for name, a, b in zip(names, with_drafter, without):
        if a != b:
            divergences.append({"prompt": name, "token_index": first_divergence(a, b), "drafter_tokens": len(a),
                                "baseline_tokens": len(b)})
    return {"requests": len(names), "identical": len(names) - len(divergences),
            "identical_rate": (len(names) - len(divergences)) / max(len(names), 1), "divergences": divergences[:20]}


# ----------------------------------------------------------------------------- cells
def cell(runs: list[dict]) -> dict:
    """One engine at one level over its repeats (each a timed_generate result without outputs)."""
    rates = [r["output_tokens_per_s"] for r in runs]
    median = statistics.median(rates)
    itl = [r["itl_mean_s"] for r in runs if r.get("itl_mean_s") is not None]
    ttft = [r["ttft_mean_s"] for r in runs if r.get("ttft_mean_s") is not None]
    taus = [r["acceptance"]["tau"] for r in runs if r.get("acceptance")]
    return {"output_tokens_per_s": median, "runs_tokens_per_s": rates,
            "spread": (max(rates) - min(rates)) / median if median else 0.0, "requests": runs[0]["requests"],
            "itl_mean_s": statistics.median(itl) if itl else None,
            "ttft_mean_s": statistics.median(ttft) if ttft else None,
            "tau": statistics.median(taus) if taus else None}


def speedup(engine_cell: dict, base_cell: dict) -> dict:
    """A cell against no speculation at the same level: the ratio of medians and its noise."""
    base = base_cell["output_tokens_per_s"]
    return {"speedup": engine_cell["output_tokens_per_s"] / base if base else 0.0,
            "noise": engine_cell["spread"] + base_cell["spread"]}


# ----------------------------------------------------------------------------- the schedule
def best_k(level_speedups: dict[int, dict]) -> int:
    """k -> {speedup, noise} at one level: the fastest k beating no speculation by more than its noise, else 0."""
    winners = {k: s["speedup"] for k, s in level_speedups.items() if s["speedup"] > 1 + s["noise"]}
    return max(winners, key=lambda k: (winners[k], -k)) if winners else 0


def schedule_ranges(level_ks: dict[int, int]) -> list[list[int]]:
    """Measured level -> k into vLLM's inclusive [first, last, k] ranges from batch size 1 to the last level."""
    levels = sorted(level_ks)
    per_batch = []
    for batch in range(1, levels[-1] + 1):
        if batch <= levels[0]:
            per_batch.append(level_ks[levels[0]])
        elif batch in level_ks:
            per_batch.append(level_ks[batch])
        else:
            below = max(lv for lv in levels if lv < batch)
            above = min(lv for lv in levels if lv > batch)
            per_batch.append(min(level_ks[below], level_ks[above]))
    ranges: list[list[int]] = []
    for batch, k in enumerate(per_batch, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = batch
        else:
            ranges.append([batch, batch, k])
    return ranges


def derive_schedule(speedups: dict[int, dict[int, dict]]) -> dict:
    """k -> level -> {speedup, noise} into the schedule: per level the chosen k and why, and the ranges."""
    levels = sorted({c for per_level in speedups.values() for c in per_level})
    chosen = {c: best_k({k: per_level[c] for k, per_level in speedups.items() if c in per_level}) for c in levels}
    ranges = schedule_ranges(chosen)
    return {SCHEDULE_FIELD: ranges, "num_speculative_tokens": max([k for *_, k in ranges] + [0]),
            "per_level": {str(c): {"k": chosen[c], **({"speedup": speedups[chosen[c]][c]["speedup"],
                                                      "noise": speedups[chosen[c]][c]["noise"]}
                                                     if chosen[c] else {})} for c in levels},
            "rule": "per level the fastest k beating no speculation by more than the repeats' noise, else 0; "
                    "between measured levels the smaller neighbour's k"}


def given_schedule(ranges: list, levels: list[int], num_speculative_tokens: int) -> dict:
    """A schedule the user gave (``--schedule``) in the shape of ``derive_schedule``'s: served with
    num_speculative_tokens the larger of its own largest k and ``num_speculative_tokens`` (so a schedule of
    zeros is served as a deployment with that drafter configured would be)."""
    table = schedule_lookup(ranges, max(levels), 1 << 30)
    return {SCHEDULE_FIELD: [list(r) for r in ranges],
            "num_speculative_tokens": max([k for *_, k in ranges] + [num_speculative_tokens]),
            "per_level": {str(c): {"k": table[c]} for c in levels}, "rule": "given (--schedule)"}


def schedule_lookup(schedule, max_batch: int, num_speculative_tokens: int) -> list[int]:
    """The dense batch size -> k table vLLM 0.24 builds from a schedule (index 0 unused): ranges checked as its
    scheduler checks them (UserError naming the entry), gaps and the tail carrying the previous k, every k capped
    at num_speculative_tokens (v1/spec_decode/dynamic/utils.py:7-148)."""
    where = f"speculative_config.{SCHEDULE_FIELD}"
    if not isinstance(schedule, list) or not schedule:
        raise UserError(f"{where} must be a non-empty list of [first_batch_size, last_batch_size, k]")
    table, following, last_k = [0] * (max_batch + 1), 1, None
    for i, entry in enumerate(schedule):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(isinstance(v, int) for v in entry)):
            raise UserError(f"{where}[{i}] = {entry!r}: give three integers [first, last, k]")
        first, last, k = entry
        if first < 1 or last < first or k < 0:
            raise UserError(f"{where}[{i}] = {entry!r}: needs 1 <= first <= last and k >= 0")
        if (i == 0 and first != 1) or first < following:
            raise UserError(f"{where}[{i}] = {entry!r}: ranges start at batch size 1 and must not overlap")
        for batch in range(following, min(first, max_batch + 1)):
            table[batch] = min(num_speculative_tokens, last_k)
        for batch in range(first, min(last, max_batch) + 1):
            table[batch] = min(num_speculative_tokens, k)
        following, last_k = last + 1, k
    for batch in range(following, max_batch + 1):
        table[batch] = min(num_speculative_tokens, last_k)
    return table


def schedule_spec(drafter: str, schedule: dict) -> dict:
    """The speculative_config that serves ``schedule`` (num_speculative_tokens: its largest k, at least 1)."""
    return {"method": "dflash", "model": drafter, "num_speculative_tokens": max(schedule["num_speculative_tokens"], 1),
            SCHEDULE_FIELD: schedule[SCHEDULE_FIELD]}


def capture_size(run, spec: dict | None) -> int | None:
    """The max_cudagraph_capture_size an engine of ``run`` (eval/vllm_engine.py ServedRun) is given (None: vLLM's
    default), per its ``cudagraph_capture``; ``spec``'s num_speculative_tokens (0 without one) sets the tokens of
    a decode step."""
    if run.config.enforce_eager:
        return None
    return capture_for(run.config.cudagraph_capture, run.levels, (spec or {}).get("num_speculative_tokens", 0))


def capture_for(mode: str | int, levels: list[int], k: int) -> int | None:
    """``--cudagraph-capture-size`` (auto, vllm or N tokens) for an engine serving ``levels`` at k speculative
    tokens: auto covers the largest level's decode step (rule cudagraph_ceiling), vllm keeps vLLM's default."""
    if mode == "vllm":
        return None
    if mode != "auto":
        return int(mode)
    from dflashkit.drafter.vllm_rules import vllm_cudagraph_capture_size

    return vllm_cudagraph_capture_size(max(levels), k)


# ----------------------------------------------------------------------------- k = 0 ranges that cost
def costly_zero_levels(schedule: dict, measured: dict) -> dict[str, dict]:
    """level -> the schedule engine's {speedup, noise} there, for the measured levels where the schedule says
    k = 0 and its own engine was slower than no speculation beyond the noise: the drafter's query pass still runs
    in a k = 0 range (drafter/vllm_rules.py rule "zero_k_range"), a cost no speculation does not pay."""
    return {str(c): measured[str(c)] for c, v in schedule["per_level"].items()
            if v["k"] == 0 and str(c) in measured and measured[str(c)]["speedup"] < 1 - measured[str(c)]["noise"]}


def smallest_paying_k(level_speedups: dict[int, dict]) -> int | None:
    """k -> {speedup, noise} of the fixed-k engines at one level: the smallest k never slower than no speculation
    beyond its noise (None: every k loses there)."""
    paying = [k for k, s in level_speedups.items() if k > 0 and s["speedup"] >= 1 - s["noise"]]
    return min(paying) if paying else None


def revise_zero_ranges(schedule: dict, measured: dict, speedups: dict[int, dict]) -> dict:
    """What the plan does where a measured schedule's k = 0 levels cost (``costly_zero_levels``): each such level
    takes the smallest fixed k that pays there (``smallest_paying_k`` over ``speedups``, k -> level -> {speedup,
    noise}), and the ranges are derived again (``schedule_ranges``). Returns {"costly_zero_levels": level -> the
    schedule's {speedup, noise} and the k that pays (None: none does)} and, when some level changed, "schedule":
    the revised schedule in ``derive_schedule``'s shape, served with at least the derived num_speculative_tokens."""
    costly = costly_zero_levels(schedule, measured)
    paying = {c: smallest_paying_k({k: per_level[int(c)] for k, per_level in speedups.items() if int(c) in per_level})
              for c in costly}
    out = {"costly_zero_levels": {c: {"speedup": v["speedup"], "noise": v["noise"], "k_that_pays": paying[c]}
                                  for c, v in costly.items()}}
    if not any(paying.values()):
        return out
    level_ks = {int(c): (paying.get(c) or v["k"]) for c, v in schedule["per_level"].items()}
    ranges = schedule_ranges(level_ks)
    per_level = {str(c): ({"k": k, **{n: speedups[k][c][n] for n in ("speedup", "noise")}} if k else {"k": 0})
                 for c, k in level_ks.items()}
    out["schedule"] = {SCHEDULE_FIELD: ranges,
                       "num_speculative_tokens": max([k for *_, k in ranges] + [schedule["num_speculative_tokens"]]),
                       "per_level": per_level,
                       "rule": "the schedule's k = 0 levels that measured slower than no speculation beyond the "
                               "noise take the smallest k never slower than no speculation there"}
    return out


def never_loses(levels: dict) -> bool:
    """level -> {speedup, noise}: no level slower than no speculation beyond its noise."""
    return all(v["speedup"] >= 1 - v["noise"] for v in levels.values())


def pays_up_to(levels: dict) -> int | None:
    """level -> {speedup, noise}: the largest level up to which every level beats no speculation beyond the
    noise (None: not even the first)."""
    up_to = None
    for c in sorted(levels, key=int):
        if levels[c]["speedup"] <= 1 + levels[c]["noise"]:
            break
        up_to = int(c)
    return up_to


def pick_plan(engines: dict) -> dict:
    """name -> {"levels": level -> {speedup, noise}} (no speculation under "none"): the plan to deploy (module
    notes) and, when it is no speculation, the engine fastest at the lowest level and up to where it pays."""
    lowest = min(engines["none"]["levels"], key=int)
    speculating = {n: e["levels"] for n, e in engines.items() if n not in ("none", V1_RUNNER)}
    safe = [n for n, levels in speculating.items() if never_loses(levels)]
    plan = max(safe, key=lambda n: speculating[n][lowest]["speedup"]) if safe else "none"
    fastest = max(speculating, key=lambda n: speculating[n][lowest]["speedup"]) if speculating else None
    return {"plan": plan, "never_losing": sorted(safe), "fastest_at_lowest": fastest,
            "fastest_pays_up_to": pays_up_to(speculating[fastest]) if fastest else None,
            "rule": "among the engines that speculate, those never slower than no speculation beyond the noise "
                    "at any level, the fastest at the lowest level; none: no speculation"}


# ----------------------------------------------------------------------------- baselines and positions
def mtp_layers(target_config: dict) -> int:
    """MTP layers the target declares (0: none), in its config or its text_config."""
    for config in (target_config, target_config.get("text_config") or {}):
        for name in MTP_FIELDS:
            if isinstance(config.get(name), int) and config[name] > 0:
                return config[name]
    return 0


def baseline_specs(names: list[str], target_config: dict) -> tuple[dict, dict]:
    """(name -> speculative_config to run, name -> why it is skipped) for the baselines asked for."""
    run, skipped = {}, {}
    for name in names:
        if name == "ngram":
            run["ngram"] = dict(NGRAM)
        elif name == V1_RUNNER:
            run[V1_RUNNER] = None  # no speculation; eval/vllm_engine.py starts it on the V1 runner
        elif name == "mtp":
            layers = mtp_layers(target_config)
            if layers:
                run["mtp"] = {"method": "mtp", "num_speculative_tokens": layers}
            else:
                skipped["mtp"] = (f"the target's config.json declares no MTP layers ({' / '.join(MTP_FIELDS)}): "
                                  "it has no MTP head to compare with")
        else:
            raise UserError(f"--baseline {name}: choose from {', '.join(BASELINES)}")
    return run, skipped


def first_positions_tau(per_position: list[float], j: int) -> float:
    """τ a drafter gets from its first j draft positions: 1 + E[min(accepted, j)] = 1 + the sum of the first j
    per-position acceptance rates (each the share of drafts with at least that many accepted)."""
    return 1.0 + sum(per_position[:j])
