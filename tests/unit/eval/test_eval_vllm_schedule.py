"""The serving plan of `dflashkit eval --engine vllm` (issue 35): several num_speculative_tokens, repeated cells,
the per-batch-size schedule (derived, written, served by the CPU twin of vllm.LLM as vLLM 0.24 expands it),
the n-gram and MTP baselines, and the report that names the schedule first."""

import json
import os
import re

import pytest

from dflashkit.errors import UserError
from dflashkit.eval.chat_settings import resolve_chat
from dflashkit.eval.options import EvalOptions
from dflashkit.eval.serving_plan import (
    baseline_specs,
    best_k,
    derive_schedule,
    first_positions_tau,
    level_requests,
    mtp_layers,
    pays_up_to,
    pick_plan,
    revise_zero_ranges,
    schedule_lookup,
    schedule_ranges,
    smallest_paying_k,
)
from dflashkit.eval.serving_verdict import plan_verdict
from dflashkit.eval.vllm_engine import VllmEvalConfig, run_vllm_eval

from support.vllm_pairs import standin_api, write_pair
from support.vllm_standin import LLM, SamplingParams, ngram_accepted

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8
BLOCK = 4
LEVELS = [1, 4, 16, 64]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A causal-in-block pair served at k 1, 2, 3 with the n-gram and MTP baselines and the schedule."""
    root = write_pair(tmp_path_factory.mktemp("plan_pair"), BLOCK, causal=True)
    warnings = []
    config = VllmEvalConfig(concurrency=LEVELS, num_speculative_tokens=[3, 1, 2], prefix_caching=["on"],
                            max_new_tokens=NEW, use_stop_tokens=False, baselines=["ngram", "mtp", "v1"], repeats=2)
    out = root / "out"
    report = run_vllm_eval(EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=out,
                                       dataset=[str(root / "chats.jsonl")], num_prompts=4), config, api=standin_api(),
                           warn=warnings.append)
    return report, out, root, warnings


def test_every_k_and_baseline_is_a_line_of_repeated_cells(planned):
    report, out, root, warnings = planned
    assert warnings == []  # a causal-in-block drafter serves k < block_size - 1 as trained: nothing to warn
    assert report["ks"] == [1, 2, 3] and report["num_speculative_tokens"] == 3
    assert set(report["engines"]) == {"none", "k1", "k2", "k3", "ngram", "v1", "schedule"}
    assert report["baselines"]["ngram"]["speculative_config"]["method"] == "ngram"
    assert "no MTP layers" in report["baselines"]["mtp"]["skipped"]
    none = report["engines"]["none"]["levels"]
    for engine in report["engines"].values():
        for c, v in engine["levels"].items():
            assert len(v["runs_tokens_per_s"]) == 2 and v["output_tokens_per_s"] > 0
            assert v["speedup"] == pytest.approx(v["output_tokens_per_s"] / none[c]["output_tokens_per_s"])
    # each k engine drafted k tokens a step: its per-position acceptance has k entries, its outputs are lossless
    for k in ("1", "2", "3"):
        assert len(report["per_k"][k]["per_position_acceptance"]) == int(k)
        assert report["per_k"][k]["identical"] == "4/4"
    largest = report["per_k"]["3"]["per_position_acceptance"]
    assert report["per_k"]["3"]["tau_first_3_positions_at_k3"] == pytest.approx(1 + sum(largest))
    assert report["per_k"]["3"]["tau"] == pytest.approx(1 + sum(largest))
    partial = [json.loads(line) for line in (out / "engines.partial.jsonl").read_text().splitlines()]
    assert [e["engine"] for e in partial] == ["no_drafter", "drafter_k1", "drafter_k2", "drafter", "ngram", "v1",
                                              "schedule"]
    assert partial[0]["levels"]["1"][0]["output_tokens_per_s"] == none["1"]["runs_tokens_per_s"][0]
    # what was asked for, not the engine objects vLLM adds to the dict it is handed (the twin adds them too)
    assert partial[1]["speculative_config"] == {"method": "dflash", "model": str((root / "drafter").resolve()),
                                                "num_speculative_tokens": 1}
    md = (out / "report.md").read_text()
    assert md.splitlines()[2] == f"**{report['plan_verdict']['text']}**"  # the plan's verdict comes first
    assert ("| concurrency | no speculation, tok/s | k = 1 | k = 2 | k = 3 | schedule | n-gram | no speculation, V1"
            in md) and "- MTP: skipped" in md


def test_the_schedule_follows_the_cells_and_is_served(planned):
    report, out, _, _ = planned
    schedule = report["schedule"]
    engines = report["engines"]
    for c in map(str, LEVELS):  # the chosen k: the fastest beating no speculation by more than the noise
        beating = {int(name[1:]): engines[name]["levels"][c] for name in ("k1", "k2", "k3")
                   if engines[name]["levels"][c]["speedup"] > 1 + engines[name]["levels"][c]["noise"]}
        expected = max(beating, key=lambda k: beating[k]["speedup"]) if beating else 0
        assert schedule["per_level"][c]["k"] == expected
    # the twin's modelled steps favour speculation at 1 request and not at 64: both sides are in the schedule
    assert schedule["per_level"]["1"]["k"] > 0 and schedule["per_level"]["64"]["k"] == 0
    ranges = schedule["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 64
    written = json.loads((out / "schedule.json").read_text())
    assert written["num_speculative_tokens_per_batch_size"] == ranges
    assert written["speculative_config"]["num_speculative_tokens"] == max(k for *_, k in ranges)
    assert json.dumps(written["speculative_config"]) in written["serve_command"]
    # the schedule's own engine was measured: at 1 request it drafts like the k it names there
    k1 = schedule["per_level"]["1"]["k"]
    assert schedule["measured"]["1"] == pytest.approx(engines[f"k{k1}"]["levels"]["1"]["speedup"])
    assert set(schedule["measured"]) == set(map(str, LEVELS))
    assert report["plan_verdict"]["min_measured_speedup"] == min(schedule["measured"].values())


def test_the_plan_is_what_measured_never_slower(planned):
    """The plan deployed is chosen from every engine's own cells: one never slower than no speculation beyond
    the noise, the fastest such at 1 request; else no speculation (the twin's schedule pays the drafter's pass
    at k = 0, as vLLM 0.24's V1 proposer does, so it is slower where it says 0)."""
    report, _, _, _ = planned
    engines = report["engines"]
    safe = [n for n, e in engines.items() if n not in ("none", "v1")  # v1 does not speculate: never a plan
            and all(v["speedup"] >= 1 - v["noise"] for v in e["levels"].values())]
    expected = max(safe, key=lambda n: engines[n]["levels"]["1"]["speedup"]) if safe else "none"
    verdict = report["plan_verdict"]
    assert verdict["plan"] == expected and sorted(safe) == verdict["never_losing"]
    assert all(engines["schedule"]["levels"][c]["speedup"] < 1 for c in ("4", "16", "64"))  # k = 0 there
    assert "schedule" not in safe
    if expected == "none":
        assert re.fullmatch(f"vllm serve {report['target']['path']} --max-num-seqs 64 --dtype bfloat16 "
                            "--max-model-len [0-9]+", report["serve_command"])
        assert verdict["text"].startswith("Serve without speculation")
    else:
        assert json.dumps(engines[expected]["speculative_config"]) in report["serve_command"]
    assert "not deployed" in verdict["text"]
    # the V1 runner's own cost (no speculation on it) is named; on vLLM 0.24 it bounds any schedule (served on
    # V1), on 0.26 (the twin's default) a schedule stays on the default runner (vllm_rules.py "schedule_runner")
    assert verdict["v1_runner"] == {c: v["speedup"] for c, v in engines["v1"]["levels"].items()}
    assert report["versions"]["vllm"] == "0.26.0 (CPU stand-in)"
    assert "default (V2) model runner" in verdict["text"] and "no schedule can beat" not in verdict["text"]
    assert f"{verdict['v1_runner']['1']:.2f}× at 1" in verdict["text"]
    assert report["schedule"]["runner"].startswith("vLLM 0.26: a per-batch-size schedule runs on the V2")
    on_024 = plan_verdict({**report, "versions": {**report["versions"], "vllm": "0.24.0"}})
    assert "A schedule runs on vLLM's V1 model runner" in on_024["text"] and "no schedule can beat" in on_024["text"]


def test_pick_plan_and_where_a_k_pays():
    lv = lambda *xs: {str(c): {"speedup": s, "noise": n} for c, s, n in xs}  # noqa: E731
    engines = {"none": {"levels": lv((1, 1, 0), (64, 1, 0))},
               "k15": {"levels": lv((1, 1.3, 0.05), (64, 0.3, 0.1))},
               "k3": {"levels": lv((1, 1.1, 0.05), (64, 0.98, 0.05))},
               "schedule": {"levels": lv((1, 0.2, 0.1), (64, 0.3, 0.1))}}
    assert pick_plan(engines)["plan"] == "k3"  # 0.98 at 64 is within its noise; k15 loses there
    del engines["k3"]
    chosen = pick_plan(engines)
    assert chosen["plan"] == "none" and chosen["fastest_at_lowest"] == "k15" and chosen["fastest_pays_up_to"] == 1
    assert pays_up_to(lv((1, 1.04, 0.05), (4, 1.5, 0.1))) is None  # the first level within the noise


def test_costly_zero_levels_take_the_smallest_k_that_pays():
    """Issue 68 item 2: a k = 0 range still runs the drafter's query pass, so where the schedule's own engine
    measured a k = 0 level slower than no speculation beyond the noise, that level takes the smallest fixed k never
    slower than no speculation there; a level where every k loses keeps 0; one within the noise is left alone."""
    s = lambda x, n=0.02: {"speedup": x, "noise": n}  # noqa: E731
    schedule = {"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]], "num_speculative_tokens": 3,
                "per_level": {"1": {"k": 3}, "4": {"k": 0}, "16": {"k": 0}, "64": {"k": 0}}}
    measured = {"1": s(1.4), "4": s(0.93), "16": s(0.99), "64": s(0.80)}  # 16: within the noise of 1
    fixed = {1: {1: s(1.3), 4: s(0.99, 0.03), 16: s(0.9), 64: s(0.70)},
             2: {1: s(1.35), 4: s(0.975, 0.03), 16: s(0.9), 64: s(0.60)},
             3: {1: s(1.4), 4: s(1.0, 0.03), 16: s(0.9), 64: s(0.50)}}
    assert smallest_paying_k(fixed_at(fixed, 4)) == 1 and smallest_paying_k(fixed_at(fixed, 64)) is None
    revision = revise_zero_ranges(schedule, measured, fixed)
    assert revision["costly_zero_levels"] == {"4": {"speedup": 0.93, "noise": 0.02, "k_that_pays": 1},
                                              "64": {"speedup": 0.80, "noise": 0.02, "k_that_pays": None}}
    revised = revision["schedule"]
    assert revised["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 1], [5, 64, 0]]
    assert revised["per_level"]["4"] == {"k": 1, "speedup": 0.99, "noise": 0.03}
    assert revised["per_level"]["64"] == {"k": 0} and revised["num_speculative_tokens"] == 3
    # nothing costs beyond the noise, or nothing pays where it costs: no revised schedule
    assert revise_zero_ranges(schedule, {**measured, "4": s(0.99), "64": s(0.99)}, fixed) == {"costly_zero_levels": {}}
    assert "schedule" not in revise_zero_ranges(schedule, measured, {k: {**v, 4: s(0.9)} for k, v in fixed.items()})


def fixed_at(fixed: dict, level: int) -> dict:
    return {k: per_level[level] for k, per_level in fixed.items()}


def test_the_plan_deploys_the_revised_schedule_and_says_why(planned):
    """The planned run's k = 0 levels cost and no k pays there (the twin measures without noise): the verdict
    says so. Given a revision that measured never slower, the plan deploys it and names the levels it changed."""
    import copy

    report, out, _, _ = planned
    costly = report["schedule"]["zero_k_ranges"]["costly_zero_levels"]
    engines = report["engines"]
    assert set(costly) == {c for c, v in report["schedule"]["per_level"].items() if v["k"] == 0}
    assert all(engines["schedule"]["levels"][c]["speedup"] < 1 and v["k_that_pays"] is None for c, v in costly.items())
    assert "still runs the drafter's query pass in a k = 0 range" in report["plan_verdict"]["text"]
    assert json.loads((out / "schedule.json").read_text())["zero_k_ranges"] == costly
    changed = copy.deepcopy(report)
    revised = {"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 1]], "num_speculative_tokens": 3,
               "per_level": {"1": {"k": 3}, "4": {"k": 1}, "16": {"k": 1}, "64": {"k": 1}}}
    changed["schedule"]["zero_k_ranges"] = {"costly_zero_levels": {c: {**v, "k_that_pays": 1}
                                                                   for c, v in costly.items()}, "schedule": revised}
    changed["engines"]["schedule_revised"] = {
        "speculative_config": {**engines["schedule"]["speculative_config"],
                               "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 1]]},
        "levels": {c: {**v, "speedup": 1.5 if c == "1" else 1.0, "noise": 0.0}
                   for c, v in engines["schedule"]["levels"].items()}}
    verdict = plan_verdict(changed)
    assert verdict["plan"] == "schedule_revised"
    assert verdict["text"].startswith("Serve with the schedule [[1, 1, 3], [2, 64, 1]]")
    assert "takes there the smallest k never slower than no speculation in its own cells (k = 1 at 4" in verdict["text"]


def test_the_twin_pays_the_drafters_pass_at_k_0_as_each_release_does(planned):
    """vLLM 0.26 drafts N and keeps the first k, so a schedule's k = 0 step fills 1 + N block tokens; 0.24's V1
    proposer drafts the step's k, one query at k = 0; a fixed k fills 1 + k (rule zero_k_range)."""
    _, _, root, _ = planned
    spec = {"method": "dflash", "model": str(root / "drafter"), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 0]]}
    on_026 = LLM(str(root / "target"), speculative_config=dict(spec), max_num_seqs=8, version="0.26.0")
    on_024 = LLM(str(root / "target"), speculative_config=dict(spec), max_num_seqs=8, version="0.24.0")
    fixed = LLM(str(root / "target"), speculative_config={**spec, "num_speculative_tokens_per_batch_size": None})
    assert (on_026.draft_queries(0), on_024.draft_queries(0), fixed.draft_queries(3)) == (4, 1, 4)


def test_best_k_needs_to_beat_the_noise():
    assert best_k({1: {"speedup": 1.04, "noise": 0.05}, 3: {"speedup": 1.2, "noise": 0.3}}) == 0
    assert best_k({1: {"speedup": 1.10, "noise": 0.05}, 3: {"speedup": 1.2, "noise": 0.1}}) == 3
    assert best_k({1: {"speedup": 1.10, "noise": 0.05}, 3: {"speedup": 1.2, "noise": 0.25}}) == 1
    assert best_k({}) == 0


def test_schedule_ranges_take_the_smaller_neighbour_between_levels():
    assert schedule_ranges({1: 15, 4: 7, 16: 3, 64: 0}) == [[1, 1, 15], [2, 4, 7], [5, 16, 3], [17, 64, 0]]
    assert schedule_ranges({2: 3, 8: 3}) == [[1, 8, 3]]  # below the first level: its k; equal neighbours merge
    assert schedule_ranges({1: 0, 4: 3}) == [[1, 3, 0], [4, 4, 3]]
    derived = derive_schedule({1: {1: {"speedup": 1.2, "noise": 0.01}, 8: {"speedup": 0.9, "noise": 0.01}},
                               3: {1: {"speedup": 1.4, "noise": 0.01}, 8: {"speedup": 0.8, "noise": 0.01}}})
    assert derived["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 8, 0]]
    assert derived["per_level"]["1"] == {"k": 3, "speedup": 1.4, "noise": 0.01}
    assert derived["num_speculative_tokens"] == 3


def test_schedule_lookup_expands_and_refuses_as_vllm_does():
    assert schedule_lookup([[1, 2, 5], [4, 6, 2]], 8, 4) == [0, 4, 4, 4, 2, 2, 2, 2, 2]  # capped, gap, tail
    for bad, said in (([], "non-empty list"), ([[2, 4, 1]], "start at batch size 1"),
                      ([[1, 4, 1], [3, 8, 2]], "must not overlap"), ([[1, 4, -1]], "k >= 0"),
                      ([[1, 4]], "three integers"), ([[1, 4, 1.5]], "three integers")):
        with pytest.raises(UserError, match=said):
            schedule_lookup(bad, 8, 4)


def test_the_twin_drafts_the_step_k_of_its_batch_size(planned):
    """The twin with a schedule: k 3 when one request decodes, none from two on; its counters say so."""
    _, _, root, _ = planned
    spec = {"method": "dflash", "model": str(root / "drafter"), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 0]]}
    llm = LLM(str(root / "target"), speculative_config=spec, max_num_seqs=8, disable_log_stats=False)
    assert [llm.step_k(b) for b in (1, 2, 8)] == [3, 0, 0]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    alone = LLM(str(root / "target"), speculative_config=dict(spec, num_speculative_tokens_per_batch_size=None),
                max_num_seqs=8, disable_log_stats=False)
    prompt = {"prompt_token_ids": [1, 2, 3, 2, 3]}
    one = llm.generate([prompt], params)[0]
    assert one.outputs[0].token_ids == alone.generate([prompt], params)[0].outputs[0].token_ids
    assert _drafts(llm) == _drafts(alone) > 0  # one request: every step is a k = 3 step, as without a schedule
    before = _drafts(llm)
    twice = llm.generate([prompt, prompt], params)  # two requests in lockstep: two decode at every step, k = 0
    assert _drafts(llm) == before and twice[1].outputs[0].token_ids == one.outputs[0].token_ids


def _drafts(llm) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")


def test_ngram_lookup_and_mtp_detection():
    seq = [5, 6, 7, 8, 5, 6, 7, 9]
    assert ngram_accepted(seq, 6, 4, 2, 4) == 1  # ...5 6 | matches 5 6 -> proposes 7 8 5 6; 7 right, 8 wrong
    assert ngram_accepted(seq, 3, 4, 2, 4) == 0  # no earlier 2-gram
    assert mtp_layers({"num_nextn_predict_layers": 1}) == 1
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}}) == 2 and mtp_layers({}) == 0
    run, skipped = baseline_specs(["ngram", "mtp"], {"mtp_num_hidden_layers": 1})
    assert run["mtp"] == {"method": "mtp", "num_speculative_tokens": 1} and not skipped
    assert first_positions_tau([0.5, 0.25, 0.1], 2) == pytest.approx(1.75)


def test_flags_are_checked_before_anything_runs(tmp_path):
    for config, said in ((VllmEvalConfig(num_speculative_tokens=[3, 0]), "values >= 1"),
                         (VllmEvalConfig(repeats=0), "--repeats"),
                         (VllmEvalConfig(baselines=["eagle"]), "choose from ngram, mtp"),
                         (VllmEvalConfig(min_waves=0), "--min-waves"),
                         (VllmEvalConfig(cudagraph_capture="big"), "use auto, vllm or a number")):
        with pytest.raises(UserError, match=said):
            config.check()
    given = VllmEvalConfig(cudagraph_capture="2048")
    given.check()
    assert given.cudagraph_capture == 2048


def test_engines_get_graphs_for_their_largest_step(planned, tmp_path):
    """cudagraph_capture auto: an engine whose largest level at its k queries more than vLLM's default 512 tokens
    a step is started with max_cudagraph_capture_size covering it; the twin records what it was handed."""
    from dflashkit.eval.vllm_engine import capture_size, prepare_run, start_served

    _, _, root, _ = planned
    opts = EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=tmp_path,
                       dataset=[str(root / "chats.jsonl")], num_prompts=2)
    run = prepare_run(opts, VllmEvalConfig(concurrency=[1, 256], num_speculative_tokens=[1, 3]),
                      resolve_chat(root / "drafter", None, None), standin_api(), print)
    k3 = {"method": "dflash", "model": run.drafter, "num_speculative_tokens": 3}
    assert capture_size(run, None) is None and capture_size(run, {**k3, "num_speculative_tokens": 1}) is None  # 512
    llm = start_served(run, "drafter", k3, "on")
    assert llm.engine_kwargs["compilation_config"] == {"max_cudagraph_capture_size": 1024}  # 256 * (1 + 3)
    run.config.cudagraph_capture = "vllm"
    assert "compilation_config" not in start_served(run, "drafter", k3, "on").engine_kwargs
    # the v1 baseline: no speculation on vLLM's V1 model runner, chosen by the environment at start, then restored
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    v1 = start_served(run, "v1", None, "on")
    assert v1.model_runner == "v1" and v1.engine_kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before
    assert start_served(run, "none", None, "on").model_runner == "v2"


def test_a_level_is_whole_waves_and_at_least_min_waves():
    prompts = [(f"p{i}", [i]) for i in range(5)]
    assert [n for n, _ in level_requests(prompts, 4)] == ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "p2"]
    assert len(level_requests(prompts, 4, cap=3)) == 4 and len(level_requests(prompts, 1, cap=3)) == 3
    assert len(level_requests(prompts, 16, cap=3, min_waves=4)) == 64  # 4 waves of 16, the prompts cycled
    assert len(level_requests(prompts, 1, cap=3, min_waves=2)) == 3  # already 3 waves of 1


def test_the_twin_pays_for_steps_above_the_graph_ceiling(planned, tmp_path):
    """4 requests at k = 3 query 16 tokens a step: with graphs up to 8 tokens every decode step runs eagerly and
    the same requests take longer than with graphs up to 16 (the modelled clock: no timing involved)."""
    from dflashkit.eval.vllm_engine import prepare_run, run_requests, start_served
    from dflashkit.targets.vllm.metrics import timed_generate

    _, _, root, _ = planned
    rates = {}
    for capture in (8, 16):
        config = VllmEvalConfig(concurrency=[4], num_speculative_tokens=[3], max_new_tokens=NEW,
                                use_stop_tokens=False, cudagraph_capture=capture)
        config.check()
        opts = EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=tmp_path,
                           dataset=[str(root / "chats.jsonl")], num_prompts=4)
        run = prepare_run(opts, config, resolve_chat(root / "drafter", None, None), standin_api(), print)
        llm = start_served(run, "drafter", {"method": "dflash", "model": run.drafter, "num_speculative_tokens": 3},
                           "on")
        assert llm.graph_ceiling == capture
        rates[capture] = timed_generate(llm, run.api, run_requests(run, 4), 4, run.params)["output_tokens_per_s"]
    assert rates[8] < rates[16]
