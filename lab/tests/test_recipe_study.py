"""lab/recipe_study.py at toy size on the CPU: real online trainings of a tiny target with the testbed's tokenizer,
real live evaluations of their exports, and a results file whose tau values are those of the eval reports."""

import json
import time

import pytest

from lab import recipe_study
from lab.recipe_study import NOT_COMBINED, VARIANTS, combine_winners, main, parse_variants

from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.paths import ROOT

# every toy run: a 1-layer drafter of a tiny target, 2 steps (a check that the stages run, not a measurement)
TOY = ("max_steps=2,num_hidden_layers=1,block_size=4,compile=false,mixed_precision=no,micro_batch_tokens=400,"
       "max_length=160,eval_samples=2,eval_anchors=4,save_every=0,log_every=1,num_workers=0,"
       "drafter={intermediate_size: 64}")


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    """The studies' trainings and evaluations are processes of a tiny model, side by side on a CPU that other test
    workers share: one thread each (more only contend)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_variants_from_the_table_and_the_command_line():
    got = parse_variants(["default,muon", "mine:lr=1e-3,layer_types=[full_attention,sliding_attention],loss=kl"])
    assert got == {"default": [], "muon": ["optimizer=muon"],
                   "mine": ["lr=1e-3", "layer_types=[full_attention,sliding_attention]", "loss=kl"]}
    assert parse_variants(["sliding_window"])["sliding_window"] == VARIANTS["sliding_window"]
    for bad, message in (("nope", "unknown variant 'nope'"), ("lr=1e-3", "belongs to a variant"),
                         ("x:lr", "NAME:key=value"), ("a:lr=1,a:lr=2", "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_variants([bad])


def test_combining_the_winners_of_a_screen():
    rows = {"default": {"status": "done", "tau": 1.50, "overrides": []},
            "muon": {"status": "done", "tau": 1.60, "overrides": ["optimizer=muon"]},
            "lr_1e3": {"status": "done", "tau": 1.58, "overrides": ["lr=1e-3"]},
            "lr_2x": {"status": "done", "tau": 1.55, "overrides": ["lr=1.2e-3"]},  # same key as a better winner
            "kl": {"status": "done", "tau": 1.505, "overrides": ["loss=kl", "kl_weight=0.5"]},  # within the margin
            "linear_decay": {"status": "done", "tau": 1.40, "overrides": ["lr_schedule=linear"]},  # a loser
            "sliding_window": {"status": "done", "tau": 1.90, "overrides": ["sliding_window=2048"]},  # not combined
            "tokens_8k": {"status": "eval_failed", "overrides": ["micro_batch_tokens=8192"]},  # no tau
            "anchors": {"status": "train_failed", "tau": 9.9, "overrides": ["anchor_density=0.2"]}}  # not evaluated
    assert "sliding_window" in NOT_COMBINED and "extra_answers" in NOT_COMBINED
    assert combine_winners(rows, margin=0.01) == (["muon", "lr_1e3"], ["optimizer=muon", "lr=1e-3"])
    assert combine_winners(rows, margin=0.09) == (["muon"], ["optimizer=muon"])
    assert combine_winners(rows, margin=0.01, exclude=()) == (
        ["sliding_window", "muon", "lr_1e3"], ["sliding_window=2048", "optimizer=muon", "lr=1e-3"])
    partial = {**rows, "default": {**rows["default"], "status": "eval_partial"},  # cut by the eval time limit
               "muon": {**rows["muon"], "status": "eval_partial"}}
    assert combine_winners(partial, margin=0.01) == (["muon", "lr_1e3"], ["optimizer=muon", "lr=1e-3"])
    with pytest.raises(ValueError, match="no evaluated 'default' row"):
        combine_winners({k: v for k, v in rows.items() if k != "default"}, margin=0.01)


def test_a_seed_replicate_of_the_default_widens_the_margin_and_never_wins():
    rows = {"default": {"status": "done", "tau": 1.50, "overrides": []},
            "seed_1": {"status": "done", "tau": 1.57, "overrides": ["seed=1"]},  # the noise: 0.07
            "muon": {"status": "done", "tau": 1.60, "overrides": ["optimizer=muon"]},  # beyond it
            "lr_1e3": {"status": "done", "tau": 1.56, "overrides": ["lr=1e-3"]}}  # within it
    assert combine_winners(rows, margin=0.01) == (["muon"], ["optimizer=muon"])
    # a replicate below the default widens the margin as much as one above it
    below = {**rows, "seed_1": {**rows["seed_1"], "tau": 1.45}}
    assert combine_winners(below, margin=0.01) == (["muon", "lr_1e3"], ["optimizer=muon", "lr=1e-3"])
    # a replicate that was not evaluated says nothing about the noise
    lost = {**rows, "seed_1": {"status": "train_failed", "overrides": ["seed=1"]}}
    assert combine_winners(lost, margin=0.01) == (["muon", "lr_1e3"], ["optimizer=muon", "lr=1e-3"])
    # a row that sets the seed and something else is a variant, not a replicate
    mixed = {**rows, "seed_1": {**rows["seed_1"], "overrides": ["seed=1", "lr=2e-3"], "tau": 1.70}}
    assert combine_winners(mixed, margin=0.01)[0] == ["seed_1", "muon"]
    assert VARIANTS["seed_1"] == ["seed=1"] and VARIANTS["tokens_4k"] == ["micro_batch_tokens=4096"]


def test_every_study_row_loads_against_the_recipe():
    """Each row's overrides are TrainConfig fields with valid values on top of the testbed recipe (the `{...}`
    placeholders filled as the study fills them), so no row of a GPU lease fails at its start; a budgeted row
    plans its schedule to its own end."""
    from dflashkit.train.recipe import load_config

    for name, overrides in VARIANTS.items():
        # `data+=FILE` is the study's own (more data files for the run), not a TrainConfig override
        filled = [recipe_study.fill(o, double_epochs=6, half_epochs=1) for o in overrides if not o.startswith("data+=")]
        cfg = load_config(str(ROOT / "recipes" / "smollm2-135m.yaml"), filled)
        for item in filled:
            key = item.split("=")[0].rstrip("+")
            assert hasattr(cfg, key), (name, item)
    assert load_config(str(ROOT / "recipes" / "smollm2-135m.yaml"), VARIANTS["steps_1000"]).max_steps == 1000
    assert {"steps_1000", "steps_1400", "steps_2000", "steps_1000_anchors", "steps_1400_anchors"} <= set(NOT_COMBINED)
    # a YAML mapping's braces are not placeholders: the DFlash2 size rows keep theirs
    assert recipe_study.fill("epochs={half_epochs}", half_epochs=1) == "epochs=1"
    for name, field, value in (("dflash2_kernel4", "conv_kernel_size", 4), ("dflash2_top32", "selector_top_k", 32)):
        cfg = load_config(str(ROOT / "recipes" / "smollm2-135m.yaml"), VARIANTS[name])
        assert cfg.drafter_architecture == "dflash2" and cfg.drafter == {field: value}, (name, cfg.drafter)


@pytest.mark.slow
def test_toy_study_trains_evaluates_and_tabulates_each_variant(tmp_path, capsys):
    target = save_tiny_chat_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(16, seed=5))
    out = tmp_path / "study"
    rc = main(["--target", target, "--data", data, "--out", str(out), "--epochs", "1", "--parallel", "2",
               "--variants", "default,mix:optimizer=muon,anchor_density=0.2,bad:loss=nope", "--device", "cpu",
               "--num-prompts", "1", "--max-new-tokens", "8", "--extra-overrides", TOY])
    assert rc == 1  # one variant failed
    log = capsys.readouterr().out
    assert "mix: training (optimizer=muon anchor_density=0.2)" in log and "bad: training failed" in log
    results = json.loads((out / "results.json").read_text())["variants"]
    assert set(results) == {"default", "mix", "bad"}
    assert results["bad"]["status"] == "train_failed" and "loss" in results["bad"]["error"]
    for name in ("default", "mix"):
        row = results[name]
        assert row["status"] == "done", row
        report = json.loads((out / "results" / name / "report.json").read_text())  # copied from the eval
        assert row["tau"] == report["overall"]["tau"] and 1.0 <= row["tau"] <= 4.0
        assert row["per_position_acceptance"] == report["overall"]["per_position_acceptance"]
        assert len(row["per_position_acceptance"]) == 3 and row["step"] == 2
        assert row["train_wall_s"] > 0 and row["eval_wall_s"] > 0 and row["train_tokens_per_s_median"] > 0
        assert (out / "results" / name / "summary.json").is_file()
        assert (out / "results" / name / "metrics.jsonl").is_file()
    assert results["mix"]["overrides"] == ["optimizer=muon", "anchor_density=0.2"]
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in results)
    # a second study over the same OUT keeps the finished variants and does not run them again
    rc = main(["--target", target, "--data", data, "--out", str(out), "--variants", "default", "--device", "cpu",
               "--extra-overrides", TOY])
    assert rc == 0 and "default: done in an earlier run" in capsys.readouterr().out


@pytest.mark.slow
def test_train_stage_then_eval_stage_over_the_same_out(tmp_path, capsys):
    target = save_tiny_chat_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(12, seed=9))
    out = tmp_path / "study"
    common = ["--target", target, "--data", data, "--out", str(out), "--epochs", "1", "--device", "cpu",
              "--num-prompts", "1", "--max-new-tokens", "8", "--extra-overrides", TOY]
    assert main([*common, "--variants", "default", "--stage", "eval"]) == 1  # nothing trained yet
    assert "needs an earlier --stage train over this --out" in capsys.readouterr().out
    started = time.time()
    assert main([*common, "--variants", "default", "--stage", "train", "--rerun"]) == 0
    assert "--stage eval evaluates it" in capsys.readouterr().out
    # what tells a run the time limit reached while it was ending from one it stopped: the export and a
    # summary.json written since the stage began (older: an earlier run's; no export: not finished)
    run_dir = out / "work" / "train" / "default"
    outcome = recipe_study.train_outcome
    later = time.time() + 60
    assert outcome(0, False, run_dir, started) == "exported"
    assert outcome(-2, True, run_dir, started) == "exported"  # SIGINT while it was ending: kept
    assert outcome(-2, True, run_dir, later) == "checkpoint"  # an earlier run's summary: its checkpoint
    assert outcome(1, False, run_dir, started) == "failed"  # failed on its own: nothing exported
    config = run_dir / "export" / "config.json"
    config.rename(config.with_suffix(".away"))
    assert outcome(-2, True, run_dir, started) == outcome(0, False, run_dir, started) == "checkpoint"
    config.with_suffix(".away").rename(config)
    row = json.loads((out / "results.json").read_text())["variants"]["default"]
    assert row["status"] == "trained" and row["step"] == 2 and "tau" not in row
    assert not (out / "results" / "default" / "report.json").exists()
    assert main([*common, "--variants", "default", "--stage", "eval"]) == 0
    assert "default: training" not in capsys.readouterr().out  # evaluated without training again
    row = json.loads((out / "results.json").read_text())["variants"]["default"]
    report = json.loads((out / "results" / "default" / "report.json").read_text())
    assert row["status"] == "done" and row["step"] == 2 and row["tau"] == report["overall"]["tau"]
    # an evaluation cut by --eval-time-limit is evaluated again by a later --stage eval (with a longer limit)
    results = json.loads((out / "results.json").read_text())
    results["variants"]["default"].update(status="eval_partial", tau=0.5)
    (out / "results.json").write_text(json.dumps(results))
    assert main([*common, "--variants", "default", "--stage", "eval"]) == 0
    assert "default: tau" in capsys.readouterr().out
    row = json.loads((out / "results.json").read_text())["variants"]["default"]
    assert row["status"] == "done" and row["tau"] == report["overall"]["tau"]
    # without its export it says which file is missing
    config.rename(config.with_suffix(".away"))
    results["variants"]["default"].update(status="eval_partial")
    (out / "results.json").write_text(json.dumps(results))
    assert main([*common, "--variants", "default", "--stage", "eval"]) == 1
    assert f"needs the export of an earlier --stage train in {run_dir}" in capsys.readouterr().out
    # an export in the work directory that this --out has no training of is not evaluated, a second time neither
    config.with_suffix(".away").rename(config)
    del results["variants"]["default"]
    (out / "results.json").write_text(json.dumps(results))
    for _ in range(2):
        assert main([*common, "--variants", "default", "--stage", "eval"]) == 1
        assert "needs an earlier --stage train over this --out" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["variants"]["default"]["status"] == "not_trained"


@pytest.mark.slow
def test_combined_winners_and_extra_data_are_trained(tmp_path, capsys):
    target = save_tiny_chat_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(12, seed=3))
    sampled = write_jsonl(tmp_path / "sampled.jsonl", chat_records(12, seed=4))
    screen = tmp_path / "screen.json"  # a screening study's results (its taus are the input here)
    screen.write_text(json.dumps({"variants": {
        "default": {"status": "done", "tau": 1.20, "overrides": []},
        "muon": {"status": "done", "tau": 1.35, "overrides": ["optimizer=muon"]},
        "mix": {"status": "done", "tau": 1.25, "overrides": ["anchor_density=0.2"]}}}))
    out = tmp_path / "study"
    rc = main(["--target", target, "--data", data, "--out", str(out), "--epochs", "1", "--device", "cpu",
               "--variants", "extra_answers", "--extra-data", sampled, "--combine", str(screen),
               "--combine-margin", "0.1", "--num-prompts", "1", "--max-new-tokens", "8", "--extra-overrides", TOY])
    assert rc == 0
    assert "winners over default (tau 1.200 + 0.100): muon 1.350 -> combo: optimizer=muon" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())["variants"]
    assert set(results) == {"extra_answers", "combo"}  # mix is within the margin: no combo_minus_* either
    assert results["combo"]["overrides"] == ["optimizer=muon"] and results["combo"]["status"] == "done"
    assert results["extra_answers"]["status"] == "done"
    command = (out / "results" / "extra_answers" / "train.log").read_text().splitlines()[0]
    assert f"--data {data} --data {sampled}" in command and "data+=" not in command
    # without a sampled set the extra_answers row cannot run, and says why
    rc = main(["--target", target, "--data", data, "--out", str(tmp_path / "bad"), "--variants", "extra_answers",
               "--device", "cpu", "--extra-overrides", TOY])
    assert rc == 1 and "data+= without a path: give --extra-data" in capsys.readouterr().out
