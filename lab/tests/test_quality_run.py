"""lab/testbed_quality_run.sh, the one-GPU script of the quality issue, run at its CPU scale (SCALE=toy) on the
SmolLM2 testbed: every user turn of multi-turn conversations answered by the target, the regenerated data in
pieces that put back together give that file, the recipe trained on it with its held-out curve, vLLM's CPU
stand-in (support/vllm_standin.py) measuring τ on MT-bench and HumanEval, live chain τ in `dflashkit eval`, and the
curve against seconds. A check that the stages fit together, not a measurement."""

import gzip
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from support.chat_data import chat_records
from support.run_scripts import ROOT, run_toy_script, toy_data


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_the_quality_run_script_runs_every_stage_at_toy_scale(tmp_path):
    data = toy_data(tmp_path / "data", sharegpt_turns=6, mtbench=3, humaneval=3)
    user_turns = sum(m["role"] == "user" for r in jsonl(data / "sharegpt_turns.jsonl") for m in r["messages"])
    assert user_turns > 6  # the toy conversations have several turns
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_run.sh", run, limits=("L_REGEN", "L_TRAIN", "L_VLLM", "L_EVAL"),
                          TARGET="testbed:smollm2", DATA=str(data), KEEP_DRAFTER="1", WARM="1", WARM_STEPS="2")
    assert set(ends) == {"warm-compile", "regenerate", "train-recipe", "vllm-tau-mtbench", "vllm-tau-humaneval",
                         "eval-recipe", "time-to-quality"}, ends
    out = run / "out"

    # the warm run trained on stand-ins of the turns the target answers: each user turn answered by its own text
    assert f"--data {run / 'warm.jsonl'} output_dir=" in (run / "stages.txt").read_text()
    assert json.loads((run / "warm" / "summary.json").read_text())["step"] == 2
    turns = jsonl(data / "sharegpt_turns.jsonl")
    source = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in turns]
    stand_in = jsonl(run / "warm.jsonl")
    assert [[m["content"] for m in r["messages"]] for r in stand_in] == [[u for u in us for _ in "ua"] for us in source]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] * (len(r["messages"]) // 2)
               for r in stand_in)

    # every turn answered, each after the target's own earlier answers; the pieces put back together are the file
    regen = jsonl(run / "regen.jsonl")
    answers = sum(m["role"] == "assistant" for r in regen for m in r["messages"])
    assert len(regen) == 6 and answers > len(regen)
    for row in regen:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * (len(row["messages"]) // 2)
    pieces = sorted((out / "regen").glob("regen.jsonl.gz.*"))
    assert pieces and gzip.decompress(b"".join(p.read_bytes() for p in pieces)) == (run / "regen.jsonl").read_bytes()
    assert f"regenerated: 6 conversations, {answers} answers" in (run / "stages.txt").read_text()

    # the recipe trained on it: the held-out τ_walk at every step (eval_every=1), the export kept in pieces
    metrics = jsonl(out / "recipe" / "results" / "default" / "metrics.jsonl")
    assert [r["step"] for r in metrics if "eval/tau_walk" in r][:2] == [1, 2]
    export = run / "work" / "train" / "default" / "export"
    kept = b"".join(p.read_bytes() for p in sorted((out / "drafter-default").glob("drafter.tar.*")))
    with tarfile.open(fileobj=io.BytesIO(kept)) as tar:
        assert tar.extractfile("./config.json").read() == (export / "config.json").read_bytes()

    # τ in the stand-in engine, per dataset, for the one drafter at the toy's k = 3
    for name in ("mtbench", "humaneval"):
        served = json.loads((out / "vllm" / name / "g_tau_per_k.json").read_text())
        assert [(r["drafter"], r["k"]) for r in served["rows"]] == [("default", 3)], name
        row = served["rows"][0]
        assert row["drafts"] > 0 and 1.0 <= row["tau"] <= 4.0 and served["datasets"] == [str(data / f"{name}.jsonl")]

    # live chain τ in dflashkit eval, copied into the study's results
    row = json.loads((out / "recipe" / "results.json").read_text())["variants"]["default"]
    report = json.loads((out / "recipe" / "results" / "default" / "report.json").read_text())
    assert row["status"] == "done" and row["tau"] == report["overall"]["tau"] >= 1.0

    # the held-out curve against seconds, the regeneration's seconds added
    curve = json.loads((out / "time_to_quality.json").read_text())
    (summary,) = curve.values()
    assert summary["offset_s"] > 0 and [p["step"] for p in summary["timeline"]][:2] == [1, 2]


@pytest.mark.slow
def test_the_lease_script_runs_the_kernels_the_pair_and_first_turns_time_to_quality(tmp_path):
    """lab/testbed_quality_lease.sh STAGES="kernels pairs optim ttq data" at toy scale. kernels: the selector-pair and
    convolution benchmarks (torch alone on a CPU); pairs: DFlash2 beside DFlash in one process, with both
    kernels asked for (the torch paths on a CPU) and without, each profiled (PAIR_PROFILE=1); optim: the step
    with AdamW, Muon one matrix at a time, Muon stacked (profiled: OPTIM_PROFILE) and stacked in bf16; data: the
    start-up's data step timed both ways on the ttq stage's answers; ttq: the quality run with
    TURNS=first (only the first user turn of each conversation of sharegpt.jsonl answered, even beside a file of
    every turn), TTQ_L_EVAL (the export's live chain τ in `dflashkit eval` after vLLM), vLLM on MT-bench alone
    although HumanEval is in the data, TTQ_MORE (an override of the recipe, on the training's command line), and
    TTQ_WARM=1 (WARM=1: a short training on stand-ins of the turns beside the answering, ended before stage 2
    starts; 2 steps, the toy scale's own, without WARM_STEPS); the training's log says where its start-up went.
    READY names a file that is there."""
    data = toy_data(tmp_path / "data", sharegpt=4, sharegpt_turns=3, mtbench=2, humaneval=2)
    run = tmp_path / "run"
    ready = tmp_path / "ready"
    ready.touch()
    forms = ("adamw", "muon_one", "muon", "muon_bf16")
    ends = run_toy_script("testbed_quality_lease.sh", run, STAGES="kernels pairs optim ttq data", READY=str(ready),
                          TARGET="testbed:smollm2", DATA=str(data), TTQ_WARM="1", TTQ_L_EVAL="120", PAIR_PROFILE="1",
                          OPTIM_FORMS=" ".join(forms), OPTIM_PROFILE="muon", TTQ_MORE="muon_ns_dtype=bfloat16")
    assert set(ends) == {"kernels-bench", "conv-bench", "pair-both", "pair-plain", "ttq", "data",
                         *(f"optim-{form}" for form in forms)}, ends
    out = run / "out"
    optim = {form: json.loads((out / f"optim_{form}.json").read_text()) for form in forms}
    assert optim["adamw"]["muon"] is None and optim["adamw"]["train_config"]["optimizer"] == "adamw"
    one, stacked, bf16 = optim["muon_one"]["muon"], optim["muon"]["muon"], optim["muon_bf16"]["muon"]
    assert one["matrices"] == one["stacks"] == stacked["matrices"] > stacked["stacks"] == bf16["stacks"]
    assert stacked["ns_dtype"] == "float32" and bf16["ns_dtype"] == "bfloat16"
    assert "every operator (total ms, calls" in (out / "profile_optim_muon.txt").read_text()
    assert not (out / "profile_optim_adamw.txt").exists()
    encoded = json.loads((out / "encode_data.json").read_text())
    assert encoded["samples"] == 4 and set(encoded["runs"]) == {"together_w0", "per_record_w0"}
    assert all({"offline", "online"} <= set(r["single"]) for r in optim.values())
    assert json.loads((out / "selector_pair.json").read_text())["torch_ms"] > 0
    assert json.loads((out / "dynamic_conv.json").read_text())["compiled_ms"] > 0
    assert json.loads((out / "pair_both.json").read_text())["train_config"]["conv_kernel"] is True
    for form in ("both", "plain"):
        paired = json.loads((out / f"pair_{form}.json").read_text())["paired"]
        assert set(paired) == {"dflash", "dflash2", "dflash2_vs_dflash"}, paired
        assert paired["dflash2_vs_dflash"]["throughput_ratio"] > 0
        for arch in ("dflash", "dflash2"):  # PAIR_PROFILE=1: each architecture's steps, operator by operator
            assert "every operator (total ms, calls" in (out / f"profile_{form}_{arch}.txt").read_text()

    ttq = run / "ttq"
    lines = (ttq / "stages.txt").read_text().splitlines()
    ended = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in lines if ": rc=" in line}
    assert set(ended) == {"warm-compile", "regenerate", "train-recipe", "vllm-tau-mtbench", "eval-recipe",
                          "time-to-quality"}, lines
    assert all(" rc=0 " in line for line in ended.values()), lines
    assert "variants steps_1400" in lines[0]
    warm = json.loads((ttq / "warm" / "summary.json").read_text())
    assert warm["step"] == 2 and "eval/tau_walk" in warm  # its steps and the held-out evaluation both ran
    end = next(i for i, line in enumerate(lines) if "warm-compile: rc=" in line)
    assert end < next(i for i, line in enumerate(lines) if "train-recipe: " in line)  # stage 2 waited for it
    regen = jsonl(ttq / "regen.jsonl")
    source = jsonl(data / "sharegpt.jsonl")
    assert len(regen) == len(source) == 4
    for row, asked in zip(regen, source):
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        first = next(m for m in asked["messages"] if m["role"] == "user")
        assert row["messages"][0]["content"] == first["content"]
    assert "regenerate: the first user turn of each conversation" in (ttq / "stages.txt").read_text()
    assert list((ttq / "out" / "drafter-steps_1400").glob("drafter.tar.*"))  # KEEP_DRAFTER
    report = json.loads((ttq / "out" / "recipe" / "results" / "steps_1400" / "report.json").read_text())
    assert report["overall"]["tau"] >= 1.0  # TTQ_L_EVAL: the export's live chain τ
    train_log = (ttq / "out" / "recipe" / "results" / "steps_1400" / "train.log").read_text()
    assert "start-up: step " in train_log, train_log[-2000:]
    assert " muon_ns_dtype=bfloat16 " in train_log.splitlines()[0]  # TTQ_MORE: on the training's command line


@pytest.mark.parametrize("env, refusal", [({"STAGES": "kernels pairs_typo"}, "unknown stage pairs_typo"),
                                          ({"STAGES": "kernels pairs", "PAIR_FORMS": "plain bothh"},
                                           "unknown pair form bothh"),
                                          ({"STAGES": "kernels optim", "OPTIM_FORMS": "muon adam"},
                                           "unknown optim form adam")])
def test_the_lease_script_refuses_an_unknown_stage_or_pair_form_before_running_any(tmp_path, env, refusal):
    """A misspelt stage, or a misspelt pair or optim form where its stage runs, exits 2 before the kernels stage."""
    proc = subprocess.run(["bash", "lab/testbed_quality_lease.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env, "RUN": str(tmp_path / "run"), "DATA": str(tmp_path),
                               "SCALE": "toy"}, timeout=120)
    assert proc.returncode == 2
    log = (tmp_path / "run" / "stages.txt").read_text()
    assert refusal in log and "kernels-bench" not in log, log


@pytest.mark.slow
def test_the_lease_scripts_dflash2_stage_trains_both_architectures_on_every_answered_turn(tmp_path):
    """STAGES=dflash2 TURNS2=every VARIANTS2=default,dflash2: every user turn answered (multi-turn rows), then
    DFlash and DFlash2 side by side on them, each export of its own architecture, each walked live in
    `dflashkit eval` on MT-bench and (EVAL_HUMANEVAL=1) on HumanEval, and no vLLM stage (vLLM 0.24 serves no
    DFlash2)."""
    data = toy_data(tmp_path / "data", sharegpt=4, sharegpt_turns=3, mtbench=2, humaneval=2)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_lease.sh", run, STAGES="dflash2", TURNS2="every",
                          VARIANTS2="default,dflash2", EPOCHS2="1", L_EVAL2="120", TARGET="testbed:smollm2",
                          DATA=str(data), EVAL_HUMANEVAL="1")
    assert set(ends) == {"dflash2"}, ends
    stages = (run / "dflash2" / "stages.txt").read_text()
    assert "regenerate: rc=0" in stages and "the first user turn" not in stages and "vllm-tau" not in stages
    regen = jsonl(run / "dflash2" / "regen.jsonl")
    assert max(sum(m["role"] == "assistant" for m in row["messages"]) for row in regen) > 1  # multi-turn
    results = json.loads((run / "dflash2" / "out" / "recipe" / "results.json").read_text())["variants"]
    for name, arch in (("default", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")):
        export = json.loads((run / "dflash2" / "work" / "train" / name / "export" / "config.json").read_text())
        assert export["architectures"] == [arch], name
        assert results[name]["status"] == "done" and results[name]["tau"] >= 1.0, results[name]
        assert f"eval-humaneval-{name}: rc=0" in stages, stages
        report = json.loads((run / "dflash2" / "out" / "eval-humaneval" / name / "report.json").read_text())
        assert [Path(d).name for d in report["datasets"]] == ["humaneval.jsonl"], report["datasets"]
        assert report["overall"]["prompts"] == 1 and report["overall"]["tau"] >= 1.0, report["overall"]


@pytest.mark.slow
def test_the_quality_run_script_trains_on_an_earlier_leases_answers(tmp_path):
    """REGEN=FILE.gz (an earlier lease's out/regen pieces put back together): nothing is answered, the recipe
    trains on that file as it is, and the curve's seconds start with training (no answering to add); MORE's
    override reaches every run."""
    data = toy_data(tmp_path / "data", mtbench=2)
    earlier = chat_records(5, seed=7)
    regen = tmp_path / "regen-all.jsonl.gz"
    with gzip.open(regen, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in earlier))
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_run.sh", run, limits=("L_TRAIN", "L_VLLM"), REGEN=str(regen),
                          L_EVAL="0", MORE="seed=5", TARGET="testbed:smollm2", DATA=str(data))
    assert set(ends) == {"train-recipe", "vllm-tau-mtbench", "time-to-quality"}, ends
    assert jsonl(run / "regen.jsonl") == earlier
    answers = sum(m["role"] == "assistant" for r in earlier for m in r["messages"])
    assert f"regenerate: reused {regen} (5 conversations, {answers} answers)" in (run / "stages.txt").read_text()
    assert f"--data {run / 'regen.jsonl'} " in (run / "stages.txt").read_text()
    assert ",eval_every=1,seed=5 " in (run / "stages.txt").read_text()  # MORE: after the scale's own overrides
    (summary,) = json.loads((run / "out" / "time_to_quality.json").read_text()).values()
    assert summary["offset_s"] == 0 and summary["timeline"]


@pytest.mark.slow
def test_the_quality_run_script_serves_the_checkpoints_live_steps_names(tmp_path):
    """LIVE_STEPS: every checkpoint kept, the checkpoint of each named step that exists exported for vLLM and
    measured beside the export (<variant>_step<N>), a step without one noted; stage 5 pairs each run's live τ
    with its held-out τ_walk and gives the first measured checkpoint that reached each τ."""
    data = toy_data(tmp_path / "data", mtbench=2)
    regen = tmp_path / "regen.jsonl"
    regen.write_text("".join(json.dumps(r) + "\n" for r in chat_records(5, seed=7)))
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_run.sh", run, limits=("L_TRAIN", "L_VLLM"), REGEN=str(regen),
                          L_EVAL="0", LIVE_STEPS="1 5", TARGET="testbed:smollm2", DATA=str(data))
    assert set(ends) == {"train-recipe", "export-default_step1", "vllm-tau-mtbench", "time-to-quality"}, ends
    stages = (run / "stages.txt").read_text()
    assert ",keep_last=100000,save_every=1 " in stages
    assert "default: no checkpoint of step 5 (LIVE_STEPS)" in stages
    assert json.loads((run / "work" / "live" / "default_step1" / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"]
    rows = json.loads((run / "out" / "vllm" / "mtbench" / "g_tau_per_k.json").read_text())["rows"]
    tau = {r["drafter"]: r["tau"] for r in rows}
    assert set(tau) == {"default", "default_step1"}, rows
    (summary,) = json.loads((run / "out" / "time_to_quality.json").read_text()).values()
    pairs = summary["calibration"]["pairs"]
    assert [(p["step"], p["live"]) for p in pairs] == [(1, tau["default_step1"]), (2, tau["default"])]
    assert set(summary["live_reached"]) == {"1.7", "2.0", "2.5", "3.0"}
    refused = subprocess.run(["bash", "lab/testbed_quality_run.sh"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "RUN": str(tmp_path / "refused"), "DATA": str(data),
                                  "SCALE": "toy", "REGEN": str(regen), "LIVE_STEPS": "1200 16OO"}, timeout=120)
    assert refused.returncode == 2
    assert "LIVE_STEPS: '16OO' is not a step number" in (tmp_path / "refused" / "stages.txt").read_text()


@pytest.mark.slow
def test_the_quality_run_script_adds_a_sampled_answer_for_the_variants_that_ask(tmp_path):
    """SAMPLED=1: the same turns answered once more, sampled (stage 1b, in pieces under out/regen-sampled); the
    variants with data+={extra_data} train on both files (extra_answers_same_steps in half the epochs), the
    default on the greedy answers alone."""
    data = toy_data(tmp_path / "data", sharegpt=4, sharegpt_turns=3, mtbench=2)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_run.sh", run, limits=("L_REGEN", "L_TRAIN", "L_VLLM"), TURNS="first",
                          L_EVAL="0", SAMPLED="1", VARIANTS="default,extra_answers_same_steps", EPOCHS="2",
                          TARGET="testbed:smollm2", DATA=str(data))
    assert set(ends) == {"regenerate", "regenerate-sampled", "train-recipe", "vllm-tau-mtbench",
                         "time-to-quality"}, ends
    greedy, sampled = jsonl(run / "regen.jsonl"), jsonl(run / "regen-sampled.jsonl")
    assert [r["messages"][0] for r in sampled] == [r["messages"][0] for r in greedy] and len(greedy) == 4
    assert [r["messages"][1]["content"] for r in sampled] != [r["messages"][1]["content"] for r in greedy]
    pieces = sorted((run / "out" / "regen-sampled").glob("regen-sampled.jsonl.gz.*"))
    assert pieces and gzip.decompress(b"".join(p.read_bytes() for p in pieces)) == (
        run / "regen-sampled.jsonl").read_bytes()
    assert "regenerated, sampled: 4 conversations, 4 answers" in (run / "stages.txt").read_text()
    rows = json.loads((run / "out" / "recipe" / "results.json").read_text())["variants"]
    assert rows["extra_answers_same_steps"]["overrides"] == [f"data+={run / 'regen-sampled.jsonl'}", "epochs=1"]
    assert rows["default"]["overrides"] == [] and all(r["status"] == "trained" for r in rows.values())
    logs = run / "out" / "recipe" / "results"
    both = (logs / "extra_answers_same_steps" / "train.log").read_text()
    assert "online data: 8 samples" in both and "1 epochs =" in both
    alone = (logs / "default" / "train.log").read_text()
    assert "online data: 4 samples" in alone and "2 epochs =" in alone


@pytest.mark.slow
def test_the_lease_scripts_rows_stage_screens_rows_beside_a_sampled_answer(tmp_path):
    """STAGES=rows with a screen's settings (ROWS, MORE=max_steps=N, VLLM_SETS=mtbench): every user turn answered
    greedily and once more sampled, the rows trained side by side on the shorter schedule, the sampled answers
    given only to the row that asks for them, each export served on MT-bench alone and kept in pieces."""
    data = toy_data(tmp_path / "data", sharegpt=4, sharegpt_turns=3, mtbench=2, humaneval=2)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_lease.sh", run, STAGES="rows", ROWS="kl,extra_answers_same_steps",
                          MORE="max_steps=1", VLLM_SETS="mtbench", TARGET="testbed:smollm2", DATA=str(data))
    assert set(ends) == {"rows"}, ends
    stages = (run / "rows" / "stages.txt").read_text()
    for stage in ("regenerate", "regenerate-sampled", "train-recipe", "vllm-tau-mtbench"):
        assert f"{stage}: rc=0" in stages, stages
    assert "vllm-tau-humaneval" not in stages, stages
    results = json.loads((run / "rows" / "out" / "recipe" / "results.json").read_text())["variants"]
    sampled = f"data+={run / 'rows' / 'regen-sampled.jsonl'}"
    assert sampled in results["extra_answers_same_steps"]["overrides"] and sampled not in results["kl"]["overrides"]
    for name in ("kl", "extra_answers_same_steps"):
        summary = json.loads((run / "rows" / "work" / "train" / name / "summary.json").read_text())
        assert summary["step"] == 1 and summary["stopped_by_max_steps"], (name, summary)
        assert (run / "rows" / "out" / f"drafter-{name}" / "drafter.tar.aa").stat().st_size > 0, name
    served = json.loads((run / "rows" / "out" / "vllm" / "mtbench" / "g_tau_per_k.json").read_text())["rows"]
    assert sorted(r["drafter"] for r in served) == ["extra_answers_same_steps", "kl"], served


@pytest.mark.slow
def test_the_lease_scripts_rows_stage_answers_once_when_no_row_reads_sampled_answers(tmp_path):
    """ROWS without an extra-answers row: the turns are answered greedily only (no sampled answering, whose minutes
    no row would use), PAR3 rows at once; a DFlash2 row trains and is kept beside the DFlash one, which alone is
    served in vLLM."""
    data = toy_data(tmp_path / "data", sharegpt=4, sharegpt_turns=3, mtbench=2)
    run = tmp_path / "run"
    ends = run_toy_script("testbed_quality_lease.sh", run, STAGES="rows", ROWS="non_causal,dflash2_detached",
                          PAR3="1", EPOCHS3="3", L_EVAL3="120", MORE="max_steps=1", VLLM_SETS="mtbench",
                          TARGET="testbed:smollm2", DATA=str(data))
    assert set(ends) == {"rows"}, ends
    stages = (run / "rows" / "stages.txt").read_text()
    assert "--parallel 1 --epochs 3 " in stages, stages  # PAR3 and EPOCHS3, not the stage's defaults (2, 2)
    for stage in ("regenerate", "train-recipe", "vllm-tau-mtbench", "eval-recipe"):
        assert f"{stage}: rc=0" in stages, stages
    assert "regenerate-sampled" not in stages and not (run / "rows" / "regen-sampled.jsonl").exists(), stages
    assert "dflash2_detached: DFlash2, not served by vLLM 0.24" in stages, stages
    results = json.loads((run / "rows" / "out" / "recipe" / "results.json").read_text())["variants"]
    assert "selector_hidden_grad=false" in results["dflash2_detached"]["overrides"], results
    for name in ("non_causal", "dflash2_detached"):  # L_EVAL3: each row's live τ, the DFlash2 one's too
        report = json.loads((run / "rows" / "out" / "recipe" / "results" / name / "report.json").read_text())
        assert results[name]["tau"] == report["overall"]["tau"] >= 1, (name, results[name])
    for name in ("non_causal", "dflash2_detached"):
        summary = json.loads((run / "rows" / "work" / "train" / name / "summary.json").read_text())
        assert summary["step"] == 1 and summary["stopped_by_max_steps"], (name, summary)
        assert "3 epochs =" in (run / "rows" / "out" / "recipe" / "results" / name / "train.log").read_text(), name
        assert (run / "rows" / "out" / f"drafter-{name}" / "drafter.tar.aa").stat().st_size > 0, name
    served = json.loads((run / "rows" / "out" / "vllm" / "mtbench" / "g_tau_per_k.json").read_text())["rows"]
    assert [r["drafter"] for r in served] == ["non_causal"], served
