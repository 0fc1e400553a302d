"""`dflashkit eval --engine vllm` over the CPU twin of vllm.LLM (tests/support/vllm_standin.py): a tiny random pair that
really decodes (dflashkit's chain acceptance gives vLLM's counters), modelled step times; the report, the verdict
against its own table, lossless counts, the missing extra, the num_speculative_tokens warning, bench_vllm.py."""

import json
import sys
from pathlib import Path

import pytest
import transformers as tf

from dflashkit.cli import run_main
from dflashkit.eval.__main__ import main
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.options import EvalOptions
from dflashkit.eval.serving_plan import agreement
from dflashkit.eval.serving_verdict import verdict
from dflashkit.eval.vllm_engine import VllmEvalConfig, run_vllm_eval
from dflashkit.targets.vllm.runtime import MISSING_VLLM

from support.paths import ROOT
from support.vllm_pairs import standin_api, write_pair

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8  # new tokens per request
BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 6-token random Llama (word tokenizer w0/w1), a random drafter for it, two-turn chats."""
    return write_pair(tmp_path_factory.mktemp("vllm_pair"), BLOCK)


@pytest.fixture(scope="module")
def served(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_report")
    config = VllmEvalConfig(max_new_tokens=NEW, use_stop_tokens=False)  # levels 1 4 16 64, prefix cache on off
    report = run_vllm_eval(EvalOptions(target=str(pair / "target"), drafter=str(pair / "drafter"), out=out,
                                       dataset=[str(pair / "chats.jsonl")], num_prompts=4), config, api=standin_api())
    return report, out


def test_report_has_vllm_acceptance_levels_and_plots(served, pair):
    report, out = served
    assert json.loads((out / "report.json").read_text())["verdict"] == report["verdict"]
    md = (out / "report.md").read_text()
    assert md.startswith("# Served by vLLM 0.26.0 (CPU stand-in): the plan") and report["verdict"]["text"] in md
    assert {"speedup_vs_concurrency.png", "per_position_acceptance.png"} <= {p.name for p in out.iterdir()}
    assert report["num_speculative_tokens"] == BLOCK - 1
    assert '"num_speculative_tokens": 3' in report["serve_command_fixed_k"]
    assert report["serve_command_fixed_k"].startswith(f"vllm serve {pair / 'target'} --max-num-seqs 64 ")
    assert [r["concurrency"] for r in report["concurrency"]] == [1, 4, 16, 64]
    assert [r["requests"] for r in report["concurrency"]] == [4, 4, 16, 64]  # waves of c, prompts cycled
    # tau from the counters equals dflashkit's own chain decoder on the same prompts
    from dflashkit.eval.prompts import load_prompts

    target = tf.AutoModelForCausalLM.from_pretrained(pair / "target").eval()
    from dflashkit.drafter import load_drafter

    decoder = SpeculativeDecoder(target, load_drafter(pair / "drafter"),
                                 DecodeConfig(max_new_tokens=NEW, cuda_graphs=False))
    accepted = [decoder.generate(p.input_ids).accepted_drafts
                for p in load_prompts(str(pair / "chats.jsonl"), tf.AutoTokenizer.from_pretrained(pair / "target"), 4)]
    rounds = sum(map(len, accepted))
    acc = report["acceptance"]
    assert acc["drafts"] == rounds and acc["tau"] == pytest.approx(1 + sum(map(sum, accepted)) / rounds)
    assert acc["per_position_acceptance"] == pytest.approx(
        [sum(sum(1 for a in r if a >= k) for r in accepted) / rounds for k in (1, 2, 3)])
    assert 1 < acc["tau"] < BLOCK  # neither nothing nor everything accepted: the numbers are not degenerate
    for row in report["concurrency"]:
        d, b = row["drafter"], row["no_drafter"]
        assert row["speedup"] == pytest.approx(d["output_tokens_per_s"] / b["output_tokens_per_s"])
        assert d["ttft_mean_s"] > 0 and d["itl_mean_s"] > 0 and b["itl_mean_s"] > 0
        assert row["tau"] == pytest.approx(row["acceptance"]["tau"])


def test_outputs_are_identical_with_and_without_the_drafter(served):
    report, _ = served
    assert report["lossless"] == {"requests": 4, "identical": 4, "identical_rate": 1.0, "divergences": []}
    assert all(r["lossless"]["identical"] == r["requests"] for r in report["concurrency"])
    counted = agreement(["a", "b", "c"], [[1, 2, 3], [1, 2], [4]], [[1, 2, 3], [1, 5], [4, 4]])
    assert counted["identical"] == 1
    assert [(d["prompt"], d["token_index"]) for d in counted["divergences"]] == [("b", 1), ("c", 1)]


def test_verdict_follows_the_table(served):
    report, _ = served
    rows = report["concurrency"]
    # the modelled steps are memory bound at 1 request and compute bound at 64: the twin shows both sides
    assert rows[0]["speedup"] > 1 > rows[-1]["speedup"]
    up_to = None
    for r in rows:
        if r["speedup"] <= 1:
            break
        up_to = r["concurrency"]
    first_slow = next(r for r in rows if r["speedup"] <= 1)
    v = report["verdict"]
    assert v["faster_up_to"] == up_to
    assert f"faster up to concurrency {up_to} and slower from concurrency {first_slow['concurrency']}" in v["text"]
    assert f"τ ≈ {first_slow['tau'] / first_slow['speedup']:.2f}" in v["text"] and "model" in v["text"]
    never = verdict([{"concurrency": 1, "speedup": 0.8, "tau": 1.6}, {"concurrency": 4, "speedup": 0.5, "tau": 1.6}])
    assert never["faster_up_to"] is None and "never faster" in never["text"] and "τ ≈ 2.00" in never["text"]
    always = verdict([{"concurrency": 1, "speedup": 1.8, "tau": 2.0}, {"concurrency": 4, "speedup": 1.2, "tau": 2.0}])
    assert always["faster_up_to"] == 4 and "faster at every concurrency" in always["text"]


def test_prefix_caching_on_and_off_on_second_turns(served):
    report, _ = served
    prefix = report["prefix_caching"]
    assert set(prefix) == {"on", "off"}
    for row in prefix.values():
        assert row["requests"] == 4 and row["tau"] > 1 and row["no_drafter_tokens_per_s"] > 0


def test_missing_vllm_is_one_line_naming_the_extra(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    status = run_main("dflashkit eval", main, ["--engine", "vllm", "--target", str(pair / "target"), "--drafter",
                                               str(pair / "drafter"), "--dataset", str(pair / "chats.jsonl"),
                                               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"dflashkit eval: error: {MISSING_VLLM}"]
    assert not (tmp_path / "out").exists()


def test_other_num_speculative_tokens_warns_and_is_reported(pair, tmp_path):
    warnings = []
    config = VllmEvalConfig(concurrency=[1], prefix_caching=["on"], num_speculative_tokens=2, max_new_tokens=NEW,
                            use_stop_tokens=False)
    report = run_vllm_eval(EvalOptions(target=str(pair / "target"), drafter=str(pair / "drafter"), out=tmp_path,
                                       dataset=[str(pair / "chats.jsonl")], num_prompts=2), config, api=standin_api(),
                           warn=warnings.append)
    assert len(warnings) == 1 and "--num-speculative-tokens 2" in warnings[0] and "acceptance changes" in warnings[0]
    assert report["num_speculative_tokens"] == 2 and len(report["acceptance"]["per_position_acceptance"]) == 2
    assert any("num_speculative_tokens 2 != block_size - 1 = 3" in w for w in report["warnings"])
    assert "num_speculative_tokens 2 (block_size − 1 = 3)" in (tmp_path / "report.md").read_text()


def test_a_target_window_reaching_the_drafter_is_a_warning(pair, tmp_path):
    """vLLM 0.24 gives a target's one sliding window to the drafter's layers (drafter/vllm_rules.py "target_window"):
    a served context longer than the window is warned about and reported."""
    import shutil

    target = shutil.copytree(pair / "target", tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    warnings = []
    run = VllmEvalConfig(concurrency=[1], prefix_caching=["on"], max_new_tokens=NEW, use_stop_tokens=False)
    report = run_vllm_eval(EvalOptions(target=str(target), drafter=str(pair / "drafter"), out=tmp_path / "out",
                                       dataset=[str(pair / "chats.jsonl")], num_prompts=2), run, api=standin_api(),
                           warn=warnings.append)
    assert [w for w in warnings if "sliding_window 16" in w] and any("sliding_window 16" in w for w in
                                                                        report["warnings"])


def test_a_gguf_config_target_is_served_and_named_from_a_kept_copy(pair, tmp_path):
    """vLLM refuses a config.json with a GGUF quantization_config (rule gguf_quantization_config; the testbed's
    has one): the engines get a copy without it, kept in the report's directory, and every serve command names
    that copy, so a printed command starts; bench_vllm's `vllm serve` is given the same kind of copy."""
    import shutil

    from bench import bench_vllm as bench

    target = shutil.copytree(pair / "target", tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    run = VllmEvalConfig(concurrency=[1], prefix_caching=["on"], max_new_tokens=NEW, use_stop_tokens=False)
    report = run_vllm_eval(EvalOptions(target=str(target), drafter=str(pair / "drafter"), out=tmp_path / "out",
                                       dataset=[str(pair / "chats.jsonl")], num_prompts=2), run, api=standin_api())
    served = Path(report["target"]["served_dir"])
    assert report["target"]["gguf_quantization_config_stripped"] and served.parent == tmp_path / "out"
    assert "quantization_config" not in json.loads((served / "config.json").read_text())
    commands = [v for k, v in report.items() if k.startswith("serve_command")]
    assert commands and all(c.startswith(f"vllm serve {served} ") for c in commands)
    assert f"`{served}`, and the serve commands name it" in (tmp_path / "out" / "report.md").read_text()
    kept = bench.server_target(str(target), tmp_path / "bench")
    assert kept.parent == tmp_path / "bench" / "server" and "quantization_config" not in json.loads(
        (kept / "config.json").read_text())
    assert bench.server_target(str(pair / "target"), tmp_path / "bench") == pair / "target"  # nothing to strip


def test_the_projection_engines_get_graphs_covering_their_steps(tmp_path):
    """--parts projection starts each engine with max_cudagraph_capture_size covering its largest step at its k
    (c * (1 + k) tokens above vLLM's 512: run eagerly otherwise), records it, and keeps each engine's step times
    as it ends (the partial file, removed once the whole file is written); the largest k runs first."""
    from types import SimpleNamespace

    from bench import bench_vllm as bench
    from dflashkit.drafter.vllm_rules import vllm_cudagraph_capture_size
    from dflashkit.targets.vllm.api import VllmApi

    from support import vllm_standin

    started, clock = [], vllm_standin.ModelledClock()

    def factory(**kwargs):
        started.append(((kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0),
                        (kwargs.get("compilation_config") or {}).get("max_cudagraph_capture_size")))
        return vllm_standin.LLM(clock=clock, **kwargs)

    args = SimpleNamespace(ks=[3, 15], concurrency=[1, 40], toy=True, projection_drafter_weights=False,
                           toy_api=VllmApi(factory, vllm_standin.SamplingParams, clock),
                           projection_prompt_tokens=4, projection_new_tokens=2, gpu_memory_utilization=0.3,
                           max_model_len=64, cudagraph_capture_size="auto", acceptance_report=None,
                           projection_gpu_memory_utilization=None)
    bench.part_projection(args, tmp_path)
    expected = {k: vllm_cudagraph_capture_size(40, k) for k in (0, 3, 15)}
    assert expected[15] == 40 * 16 and expected[0] is None  # the case the rule is for, and one it leaves alone
    assert started == [(0, expected[0]), (15, expected[15]), (3, expected[3])]
    times = json.loads((tmp_path / "e_projection_times.json").read_text())
    assert times["max_cudagraph_capture_size"] == {"ar": expected[0], "k15": expected[15], "k3": expected[3]}
    assert set(times["raw"]["40"]) == {"ar", "k3", "k15", "spec"}
    assert not (tmp_path / "e_projection_times.partial.json").exists()
    assert times["gpu_memory_utilization"] == 0.3 and times["memory_sizing"] is None  # the twin models no memory


def test_the_projection_sizes_vllms_share_of_an_h100_and_an_h200():
    """Issue 68 item 3: at --gpu-memory-utilization 0.25 an H100 80GB left vLLM 0.18 GiB of KV cache for the
    Qwen3-8B shape, which needs 0.32 (one request of max_model_len 2048). The share sized from the shape leaves
    the KV cache of the largest level (128 requests of 128 + 128 tokens at k = 15) on both cards."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_vllm as bench
    from common import QWEN3_8B

    need = bench.projection_memory(QWEN3_8B, 5, 5, max_num_seqs=128, tokens_per_request=256, max_model_len=2048,
                                   max_k=15)
    one_request = bench.projection_memory(QWEN3_8B, 5, 5, 1, 256, 2048, 15)["kv_bytes"]
    assert one_request / bench.GIB == pytest.approx(0.32, abs=0.005)  # 2048 tokens x 41 layers of 8 x 128 KV heads
    assert need["weights_bytes"] / bench.GIB == pytest.approx(17.2, abs=0.1)  # 8.2B target + 5-layer drafter, bf16
    assert need["kv_tokens"] == 128 * 272  # 128 + 128 + 16 lookahead slots = 17 pages of 16 per request
    for total_mib in (81559, 143771):  # torch.cuda.mem_get_info's total on an H100 80GB and on an H200
        total = total_mib << 20
        share = bench.projection_utilization(need["bytes"], total)
        left_for_kv = share * total - need["weights_bytes"] - need["logits_bytes"] - need["headroom_bytes"]
        assert left_for_kv >= need["kv_bytes"] > one_request
        assert share - 0.01 < need["bytes"] / total <= share  # the smallest hundredth that fits
    assert bench.projection_utilization(need["bytes"], 81559 << 20) > 0.25  # what failed on the H100
    with pytest.raises(RuntimeError, match="lower --concurrency"):
        bench.projection_utilization(need["bytes"], 24 * bench.GIB)


def test_the_report_leads_with_the_plan_measured_in_vllm(served):
    """Issue 68 item 5: report.json's first field, report.md's first lines and the console's last lines are the
    plan (its serve command) and every engine's speedup per concurrency measured in vLLM; the first speedup a
    reader meets is the engine's."""
    import re

    report, out = served
    written = json.loads((out / "report.json").read_text())
    head = written["headline"]
    assert next(iter(written)) == "headline" and head["serve_command"] == report["serve_command"]
    assert head["measured_in"].startswith("vLLM 0.26.0 (CPU stand-in): output tok/s against no speculation")
    assert head["speedup"]["k = 3"] == {c: v["speedup"] for c, v in report["engines"]["k3"]["levels"].items()}
    md = (out / "report.md").read_text().splitlines()
    assert md[2] == f"**{report['plan_verdict']['text']}**" and md[7] == report["serve_command"]
    table = md.index("| concurrency | no speculation, tok/s | k = 3 | schedule |")
    assert table < 15 and "![speedup against concurrency](speedup_vs_concurrency.png)" in md[table:table + 8]
    first = re.search(r"([0-9.]+)×", "\n".join(md))[1]
    assert first in {f"{v['speedup']:.2f}" for e in report["engines"].values() for v in e["levels"].values()}
    from dflashkit.eval.__main__ import headline_console

    console = headline_console(written)  # what `eval --engine vllm` prints last
    assert console[-2:] == [f"Plan: {report['plan_verdict']['text']}", f"Serve command: {report['serve_command']}"]
    k3 = report["engines"]["k3"]["levels"]
    assert any(line.startswith(f"  k = 3: {k3['1']['speedup']:.2f}x at 1, {k3['4']['speedup']:.2f}x at 4")
               for line in console)


def test_the_harness_speedup_is_named_as_the_harness(tmp_path, capsys):
    """`dflashkit eval`'s own speedup is its decode loop's, not a serving engine's: the console, report.md and
    --compare beside a vLLM report say so."""
    from dflashkit.eval.compare import compare_reports
    from dflashkit.eval.report import render_markdown

    harness = {"args": {"mode": "chain"}, "block_size": 4, "datasets": {}, "overall": {"tau": 2.0, "speedup": 1.8},
               "target": {}, "drafter": {}, "versions": {}}
    assert HARNESS_WORDS in render_markdown({**harness, "overall": {**harness["overall"], "acceptance_histogram": {},
                                                                      "per_position_acceptance": []}})
    for name, report in (("chain", harness), ("vllm", {"engine": "vllm", **harness, "args": {"mode": "vllm"},
                                                       "overall": {"tau": 1.9, "speedup": 1.2}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(report))
    text = compare_reports([str(tmp_path / "chain"), str(tmp_path / "vllm")])
    header = next(line for line in text.splitlines() if line.startswith("| report"))
    assert "engine speedup (vLLM)" in header and "harness speedup" in header
    chain, vllm = (line.split(" | ") for line in text.splitlines() if "/chain |" in line or "/vllm |" in line)
    engine_col, harness_col = header.split(" | ").index("engine speedup (vLLM)"), header.split(" | ").index(
        "harness speedup (dflashkit's decode loop)")
    assert (chain[engine_col], chain[harness_col]) == ("—", "1.800")
    assert (vllm[engine_col], vllm[harness_col]) == ("1.200", "—")


HARNESS_WORDS = "harness speedup: dflashkit's own decode loop, not a serving engine"


def test_bench_vllm_sets_the_harness_speedup_beside_the_engines(served, tmp_path):
    """bench_vllm.py's serve part with --dflashkit-report: both ran, so a_tau.json holds the engine's speedup per
    concurrency and, named as the harness's, the chain report's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_vllm as bench

    report, _ = served
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"datasets": {report["args"]["datasets"][0]: {"tau": 1.5, "speedup": 1.7}},
                                 "overall": {"tau": 1.5, "speedup": 1.7}}))
    out = bench.tau_comparison(report, str(chain))
    assert out["engine_speedup"] == report["headline"]["speedup"] and out["harness_speedup"] == 1.7
    assert out["harness_speedup_is"] == HARNESS_WORDS


@pytest.mark.slow
def test_bench_vllm_runs_every_part_on_the_twin(tmp_path):
    from bench import bench_vllm as bench

    status = bench.main(["--out", str(tmp_path), "--num-prompts", "3", "--max-new-tokens", "6", "--concurrency", "1",
                         "4", "--projection-new-tokens", "4", "--projection-prompt-tokens", "6"], toy_api=standin_api())
    assert status == 0, [p.read_text()[:2000] for p in tmp_path.glob("*.error.json")]
    tau = json.loads((tmp_path / "a_tau.json").read_text())
    assert tau["tau_vllm"] > 1 and len(tau["per_position_acceptance_vllm"]) == 3
    assert json.loads((tmp_path / "b_lossless.json").read_text())["identical_rate"] == 1.0
    assert [r["concurrency"] for r in json.loads((tmp_path / "c_concurrency.json").read_text())["levels"]] == [1, 4]
    assert set(json.loads((tmp_path / "d_prefix_caching.json").read_text())) == {"on", "off"}
    projection = json.loads((tmp_path / "e_projection.json").read_text())
    assert projection["expected_tokens_per_step"] == pytest.approx(1 + sum(tau["per_position_acceptance_vllm"]))
    for row in projection["levels"]:
        assert row["projected_speedup"] == pytest.approx(
            projection["expected_tokens_per_step"] * row["t_ar_step_ms"] / row["t_spec_step_ms"])
    raw = json.loads((tmp_path / "e_projection_times.json").read_text())["raw"]
    assert set(projection["per_k"]) == {"1", "3", "7", "15"}  # one engine per k of --ks, with step times each
    for k, v in projection["per_k"].items():
        for c, modelled in v["projected_speedup"].items():
            assert modelled == pytest.approx(v["expected_tokens_per_step"] * raw[c]["ar"]["step_ms"]
                                             / raw[c][f"k{k}"]["step_ms"])
    chosen = projection["schedule"]["per_level"]
    for c, v in chosen.items():  # the 8B schedule takes the k with the best modelled speedup above 1, else 0
        best = max(projection["per_k"], key=lambda k: projection["per_k"][k]["projected_speedup"][c])
        above = projection["per_k"][best]["projected_speedup"][c] > 1
        assert v["k"] == (int(best) if above else 0)
    assert json.loads((tmp_path / "f_server.json").read_text())["ran"] is False
    # (f) on the GPU: each live server's cell beside the in-process engine's cell of the same name and level
    engine = json.loads((tmp_path / "serve" / "report.json").read_text())
    plan = {"engines": {name: {c: {"output_tokens_per_s": 2 * cell["output_tokens_per_s"], "speedup": 0.5,
                                   "tau": None} for c, cell in e["levels"].items()}
                        for name, e in engine["engines"].items()} | {"k99": {"1": {"output_tokens_per_s": 1.0}}}}
    paired = bench.server_vs_engine(plan, engine)
    assert set(paired) == set(engine["engines"]) and "k99" not in paired  # no in-process engine of that name
    for name, levels in paired.items():
        assert set(levels) == set(engine["engines"][name]["levels"])
        for c, row in levels.items():
            assert row["server_over_in_process"] == pytest.approx(2.0)
            assert row["in_process_speedup"] == engine["engines"][name]["levels"][c]["speedup"]
    assert bench.server_vs_engine(plan, None) == {}
    # the servers start as the in-process engines do: max_num_seqs = the top level, graphs covering k's step
    from types import SimpleNamespace

    args = SimpleNamespace(target="T", drafter="D", concurrency=[1, 64], gpu_memory_utilization=0.3,
                           max_model_len=2048, cudagraph_capture_size="auto")
    with_drafter, without = bench.server_command(args, 1, 15, "T"), bench.server_command(args, 2, None, "T")
    assert with_drafter[with_drafter.index("--max-cudagraph-capture-size") + 1] == "1024"
    assert json.loads(with_drafter[with_drafter.index("--speculative-config") + 1])["num_speculative_tokens"] == 15
    assert "--speculative-config" not in without and "--max-cudagraph-capture-size" not in without
    assert without[without.index("--max-num-seqs") + 1] == with_drafter[with_drafter.index("--max-num-seqs") + 1]
    # --cudagraph-capture-size as the in-process engines read it: vllm keeps vLLM's default, N is taken as given
    assert "--max-cudagraph-capture-size" not in bench.server_command(
        SimpleNamespace(**{**vars(args), "cudagraph_capture_size": "vllm"}), 1, 15, "T")
    given = bench.server_command(SimpleNamespace(**{**vars(args), "cudagraph_capture_size": "768"}), 1, 15, "T")
    assert given[given.index("--max-cudagraph-capture-size") + 1] == "768"

    # (a) afterwards: the tau part compares the serve report with a dflashkit eval of the same pair and prompts,
    # which the twin (dflashkit's own chain decoder inside) must match
    from dflashkit.eval.__main__ import main as eval_main

    assert eval_main(["--target", str(tmp_path / "toy" / "target"), "--drafter", str(tmp_path / "toy" / "drafter"),
                      "--dataset", str(tmp_path / "toy" / "chats.jsonl"), "--num-prompts", "3",
                      "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--baseline-prompts", "0",
                      "--out", str(tmp_path / "dk")]) == 0
    assert bench.main(["--parts", "tau", "--out", str(tmp_path), "--dflashkit-report",
                       str(tmp_path / "dk" / "report.json")]) == 0
    tau = json.loads((tmp_path / "a_tau.json").read_text())
    assert tau["tau_dflashkit"] == pytest.approx(tau["tau_vllm"]) and tau["within_3_percent"] is True
    assert tau["dflashkit_scope"] == str(tmp_path / "toy" / "chats.jsonl")  # the served dataset's own tau
    assert bench.main(["--parts", "tau", "--out", str(tmp_path / "empty")]) == 1
    assert "run --parts serve first" in (tmp_path / "empty" / "tau.error.json").read_text()


def test_per_prompt_runs_pair_with_a_local_report(pair, tmp_path, capsys):
    """--per-prompt: every prompt alone on the drafter's engine, each one's τ from the counters (the twin's are
    dflashkit's chain acceptance) and its answer in outputs.jsonl; `--compare` with a local `dflashkit eval`
    report of the same prompts finds the same answers and, on them, the same τ."""
    out, local = tmp_path / "vllm", tmp_path / "local"
    config = VllmEvalConfig(max_new_tokens=NEW, use_stop_tokens=False, concurrency=[1], repeats=1,
                            schedule_run=False, prefix_caching=["off"], per_prompt=True)
    report = run_vllm_eval(EvalOptions(target=str(pair / "target"), drafter=str(pair / "drafter"), out=out,
                                       dataset=[str(pair / "chats.jsonl")], num_prompts=4), config, api=standin_api())
    lines = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(len(x["tokens"]) == NEW for x in lines)
    assert report["per_prompt"]["prompts"] == 4 and report["per_prompt"]["rounds"] == sum(x["rounds"] for x in lines)
    # alone or together, the twin's greedy decoding is the same: the summed rounds are the batched run's drafts
    assert report["per_prompt"]["tau"] == pytest.approx(report["acceptance"]["tau"])
    assert report["per_prompt"]["rounds"] == report["acceptance"]["drafts"]
    assert len({x["tau"] for x in lines}) > 1  # per prompt, not one number copied

    assert run_main("dflashkit eval", main, [
        "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--dataset", str(pair / "chats.jsonl"),
        "--num-prompts", "4", "--max-new-tokens", str(NEW), "--no-stop", "--baseline-prompts", "0",
        "--out", str(local)]) == 0
    ours = [json.loads(x) for x in (local / "outputs.jsonl").read_text().splitlines()]
    assert [x["tokens"] for x in ours] == [x["tokens"] for x in lines]
    assert [(x["rounds"], x["round_tokens"]) for x in ours] == [(x["rounds"], x["round_tokens"]) for x in lines]
    capsys.readouterr()
    assert run_main("dflashkit eval", main, ["--compare", str(local), str(out)]) == 0
    tau = report["per_prompt"]["tau"]  # counted before the cap, so at least the local report's own τ
    assert tau >= json.loads((local / "report.json").read_text())["overall"]["tau"]
    assert f"| {out} | 4 | 4 | — | {tau:.3f} | {tau:.3f} | {tau:.3f} | {tau:.3f} |" in capsys.readouterr().out


def test_per_prompt_is_refused_by_the_local_engine(pair, tmp_path, capsys):
    assert run_main("dflashkit eval", main, [
        "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--dataset", str(pair / "chats.jsonl"),
        "--per-prompt", "--out", str(tmp_path / "x")]) == 2
    assert "--per-prompt is read by --engine vllm, not by --engine dflashkit" in capsys.readouterr().err
