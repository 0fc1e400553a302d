"""The trainer end to end on a tiny random target (CPU): refusals, overfitting, export (resume after SIGKILL:
tests/integration/test_train_processes.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflashkit.errors import UserError
from dflashkit.train.checkpoint import list_checkpoints
from dflashkit.train.recipe import load_config
from dflashkit.train.setup import lr_at
from dflashkit.train.tracking import read_metrics
from dflashkit.train.trainer import train

from support.paths import ROOT
from support.shards import make_shards
from support.training import as_argv, tiny_overrides, train_losses

RECIPES = ROOT / "recipes"


def test_run_writes_checkpoints_metrics_and_export(tiny_run, tmp_path):
    from dflashkit.drafter import load_drafter
    from dflashkit.train import export

    target, shards = tiny_run
    out = tmp_path / "run"
    summary = train(load_config(None, [], **tiny_overrides(shards, out, epochs=1, keep_last=1, eval_every=2)))
    assert summary["step"] == 5 and not summary["stopped_by_max_steps"]
    assert [p.name for p in list_checkpoints(out)] == ["step-00000005"]  # keep_last=1
    rows = read_metrics(out)
    assert {r["step"] for r in rows if "eval/tau_sim" in r} == {2, 4, 5}
    assert all(1.0 <= r["eval/tau_sim"] <= 4.0 for r in rows if "eval/tau_sim" in r)
    steps = [r for r in rows if "train/loss" in r]
    assert [r["lr"] for r in steps] == pytest.approx([6e-4 * lr_at(s, 5, 0, 0.0) for s in range(5)])
    # the export the run wrote and one made by the export command both carry the checkpoint's weights
    ckpt = out / "checkpoints" / "step-00000005"
    assert export.main([str(out), str(tmp_path / "exported")]) == 0
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    for d in (out / "export", tmp_path / "exported"):
        model = load_drafter(d)
        assert model.mask_token_id == 95 and model.block_size == 4 and model.target_layer_ids == [0, 2]
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"  # exports default to bf16
        for k, v in model.state_dict().items():
            if k in weights:
                assert torch.equal(v, weights[k].bfloat16().float()), k
    assert not any("embed" in k or "lm_head" in k for k in weights)  # nothing of the target is saved


def test_overfitting_one_sample_reaches_full_blocks(tmp_path, tiny_run):
    target, _ = tiny_run
    shards = make_shards(tmp_path / "one", target, num_samples=12, repeat_first=True, last_hidden=False)
    B = 8
    summary = train(load_config(None, [], **tiny_overrides(
        shards, tmp_path / "run", block_size=B, num_anchors=16, eval_samples=1, eval_anchors=16, epochs=8,
        grad_accum=1, lr=1e-2, warmup_ratio=0.05, save_every=0, log_every=20)))
    assert summary["eval/tau_sim"] >= 0.9 * B
    first = train_losses(tmp_path / "run")[20]
    assert summary["eval/loss"] < first


@pytest.mark.parametrize("loss", ["ce", "dpace", "kl"])
def test_loss_variants_train_and_max_steps_is_announced(tiny_run, tmp_path, capsys, loss):
    _, shards = tiny_run
    summary = train(load_config(None, [], **tiny_overrides(shards, tmp_path / loss, loss=loss, max_steps=3,
                                                           save_every=0)))
    assert "max_steps=3 stops training after 3 of 10 steps" in capsys.readouterr().out
    assert summary["stopped_by_max_steps"] and summary["step"] == 3
    losses = train_losses(tmp_path / loss)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


def test_the_start_up_is_accounted_at_the_first_logged_step(tiny_run, tmp_path, capsys):
    """The seconds before this process's first logged step, in one log line (a run stopped before its end keeps
    it) and in summary.json: the setup, its loading share, then the first steps up to that row's elapsed_s."""
    _, shards = tiny_run
    out = tmp_path / "run"
    summary = train(load_config(None, [], **tiny_overrides(shards, out, max_steps=4, log_every=2, save_every=0)))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start-up:")]
    st = summary["startup"]
    assert len(lines) == 1 and lines[0].startswith("start-up: step 2 at ") and "then 2 step(s) in" in lines[0]
    assert st["first_log_step"] == 2 and st["from_step"] == 0 and "compiled_graphs" not in st  # compile=false
    assert 0 < st["load_s"] <= st["setup_s"] <= st["first_log_s"]
    parts = [st["data_s"], st["target_s"], st["drafter_s"]]  # the load's parts, each timed: shards, head, drafter
    assert all(p > 0 for p in parts) and sum(parts) <= st["load_s"]
    assert (f"(loads {st['load_s']:.0f} s: data {st['data_s']:.0f} s, target {st['target_s']:.0f} s, "
            f"drafter {st['drafter_s']:.0f} s)") in lines[0]
    row = next(r for r in read_metrics(out) if r["step"] == 2 and "train/loss" in r)
    assert st["setup_s"] < row["elapsed_s"] <= st["first_log_s"]
    assert json.loads((out / "summary.json").read_text())["startup"] == st
    assert "imports_s" not in st and "imports" not in lines[0]  # called in-process: its clock starts at the call


def test_the_command_counts_its_imports_in_the_runs_clock(tiny_run, tmp_path, capsys):
    """`dflashkit train` (its main) starts metrics.jsonl's clock at the process's first import of dflashkit, so
    a run's wall time counts the command's imports (torch, transformers) before ``train`` was called; the
    start-up line and summary.json say how long they took."""
    import dflashkit
    from dflashkit.train.__main__ import main

    _, shards = tiny_run
    out = tmp_path / "run"
    assert main(as_argv(tiny_overrides(shards, out, max_steps=2, log_every=2, save_every=0))) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start-up:")]
    st = json.loads((out / "summary.json").read_text())["startup"]
    assert 0 < st["imports_s"] < st["setup_s"] and f"(imports {st['imports_s']:.0f} s; loads " in lines[0]
    for row in read_metrics(out):  # every row's clock began at the import, not at the call
        assert row["wall_time"] - row["elapsed_s"] == pytest.approx(dflashkit.IMPORTED_AT, abs=1e-3)


def test_manifest_mismatch_is_refused_naming_the_field(tiny_run, tmp_path):
    target, shards = tiny_run
    with pytest.raises(ValueError, match=r"^target_layer_ids: the shards were extracted with"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "a", target_layer_ids=[1, 2])))
    other = tmp_path / "other-target"
    shutil.copytree(target, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    cfg.setdefault("rope_parameters", {})["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^target\.config_hash: the shards come from a different target"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "b", target=str(other))))
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_shard_is_refused_naming_it(tiny_run, tmp_path, damage):
    _, shards = tiny_run
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    victim = sorted(copy.glob("shard-*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) - 100]
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="refusing to train on damaged shards") as err:
        train(load_config(None, [], **tiny_overrides(copy, tmp_path / "run")))
    assert str(victim) in str(err.value)
    assert ("sha256" if damage == "flip" else "size") in str(err.value)
    assert "\n" not in str(err.value) and f"dflashkit verify {copy}" in str(err.value)  # one line, the fix


def test_several_damaged_shards_are_one_line_naming_the_first_and_the_count(tiny_run, tmp_path):
    _, shards = tiny_run
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    victims = sorted(copy.glob("shard-*.safetensors"))
    assert len(victims) >= 2
    for victim in victims:
        victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(UserError) as err:
        train(load_config(None, [], **tiny_overrides(copy, tmp_path / "run")))
    message = str(err.value)
    assert "\n" not in message and str(victims[0]) in message and str(victims[1]) not in message
    assert f"(and {len(victims) - 1} more)" in message and "--overwrite" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_recipes_load_with_their_stated_values():
    names = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "tiny")  # tiny.yaml: the tests'
    assert {"smollm2-135m", "smollm2-135m-cpu", "qwen3-8b", "llama-3.1-8b-instruct", "qwen3.6-27b"} <= set(names)
    for name in names:
        cfg = load_config(str(RECIPES / f"{name}.yaml"))
        assert cfg.block_size == 16 and cfg.gamma == 7.0 and cfg.lr == 6e-4 and cfg.warmup_ratio == 0.04
        assert cfg.loss == "dpace"  # the winner of the comparison in lab/NOTEBOOK.md
        if name not in ("smollm2-135m", "smollm2-135m-cpu"):
            assert (cfg.num_hidden_layers, cfg.epochs, cfg.max_length, cfg.max_steps) == (5, 6, 3072, 0)
    hybrid = load_config(str(RECIPES / "qwen3.6-27b.yaml"))
    assert hybrid.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and hybrid.sliding_window == 2048
    assert load_config(str(RECIPES / "smollm2-135m-cpu.yaml")).mixed_precision == "no"
    testbed = load_config(str(RECIPES / "smollm2-135m.yaml"))  # the recipe study's winners (lab/NOTEBOOK.md)
    assert (testbed.micro_batch_tokens, testbed.optimizer, testbed.layer_types) == (4096, "muon", [])
    cfg = load_config(str(RECIPES / "qwen3-8b.yaml"), ["lr=1e-4", "loss=ce", "layer_types=[]"])
    assert (cfg.lr, cfg.loss) == (1e-4, "ce")
    with pytest.raises(ValueError, match="unknown field 'learning_rate'"):
        load_config(str(RECIPES / "qwen3-8b.yaml"), ["learning_rate=1e-4"])
    for f in ("ddp", "fsdp", "zero2", "zero3"):
        assert (RECIPES / "accelerate" / f"{f}.yaml").is_file()


def test_lr_schedule_warmup_then_cosine():
    assert lr_at(0, 100, 4, 0.0) == pytest.approx(0.25)
    assert lr_at(3, 100, 4, 0.0) == pytest.approx(1.0)
    assert lr_at(4, 100, 4, 0.0) == pytest.approx(1.0)
    assert lr_at(52, 100, 4, 0.0) == pytest.approx(0.5)
    assert lr_at(99, 100, 4, 0.1) == pytest.approx(0.1, abs=2e-3)


def _with_tokenizer(target: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(target, out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(90)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out)
    return out


def test_bad_configuration_fails_before_work_naming_the_field(tiny_run, tmp_path):
    from dflashkit.extract.shards.manifest import read_manifest, write_manifest

    target, shards = tiny_run
    cases = [({"target_layer_ids": [0, 99]}, r"target_layer_ids \[0, 99\]: \[99\] outside 0\.\.3"),
             ({"mask_token_id": 500}, r"mask_token_id 500 is outside the target's vocabulary"),
             ({"loss": "kl", "shards": None}, r"loss=kl needs last_hidden")]
    plain = make_shards(tmp_path / "no-last", target, num_samples=4, last_hidden=False)
    for i, (kw, message) in enumerate(cases):
        data = plain if "shards" in kw else shards
        kw = {k: v for k, v in kw.items() if k != "shards"}
        with pytest.raises(ValueError, match=message):
            train(load_config(None, [], **tiny_overrides(data, tmp_path / f"r{i}", eval_samples=1, **kw)))
        assert not (tmp_path / f"r{i}" / "checkpoints").exists()
    # shards extracted with another tokenizer
    copy = tmp_path / "shards-tok"
    shutil.copytree(shards, copy)
    manifest = read_manifest(copy)
    manifest["tokenizer_hash"] = "0" * 64
    write_manifest(copy / "manifest.json", manifest)
    with pytest.raises(ValueError, match=r"^tokenizer_hash: the shards come from a different target"):
        train(load_config(None, [], **tiny_overrides(copy, tmp_path / "tok",
                                                     target=str(_with_tokenizer(target, tmp_path / "t")))))


def test_nan_features_are_refused(tiny_run, tmp_path):
    import hashlib

    from dflashkit.extract.shards.format import read_shard_header
    from dflashkit.extract.shards.manifest import read_manifest, write_manifest

    _, shards = tiny_run
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    manifest = read_manifest(copy)
    entry = manifest["shards"][0]
    path = copy / entry["file"]
    table, _, _ = read_shard_header(path)
    data = bytearray(path.read_bytes())
    start = table["hidden"][2]
    data[start:start + 2] = b"\xc0\x7f"  # bf16 NaN in the first value of the first token
    path.write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()  # a NaN written at extraction, not a damaged file
    write_manifest(copy / "manifest.json", manifest)
    first = entry["sample_indices"][0]
    message = rf"{entry['file']}: hidden holds NaN/Inf \(first at token 0, sample {first}\)"
    with pytest.raises(ValueError, match=message):
        train(load_config(None, [], **tiny_overrides(copy, tmp_path / "a")))
    # without the up-front check, the sample is refused when it is read
    with pytest.raises(ValueError, match=r"sample \d+: NaN or Inf in the stored features \(field hidden\)"):
        train(load_config(None, [], **tiny_overrides(copy, tmp_path / "b", verify_shards=False, eval_samples=0,
                                                     max_steps=0)))


def test_init_from_a_drafter_directory(tiny_run, tmp_path):
    from safetensors.torch import load_file

    _, shards = tiny_run
    first = tmp_path / "first"
    train(load_config(None, [], **tiny_overrides(shards, first, epochs=1, save_every=0)))
    start = load_file(str(first / "export" / "model.safetensors"))
    # lr 0: the fine-tuning run's final weights are exactly the drafter it started from
    again = tmp_path / "again"
    summary = train(load_config(None, [], **tiny_overrides(shards, again, init_from=str(first / "export"),
                                                           lr=0.0, epochs=1, save_every=0)))
    end = load_file(str(Path(summary["checkpoint"]) / "model.safetensors"))
    assert sorted(start) == sorted(end) and all(torch.equal(start[k], end[k]) for k in start)
    with pytest.raises(ValueError, match="was trained with 95"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "bad", init_from=str(first / "export"),
                                                     mask_token_id=7)))


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    from dflashkit.cli import run_main
    from dflashkit.train.__main__ import main as train_main
    from dflashkit.train.export import main as export_command

    def main(argv):
        return run_main("dflashkit train", train_main, argv)

    def export_main(argv):
        return run_main("dflashkit export", export_command, argv)

    assert main(["--recipe", str(RECIPES / "smollm2-135m-cpu.yaml")]) == 2
    assert "dflashkit train: error: shards: no shard directory given" in capsys.readouterr().err
    assert main([f"--shards={tmp_path}", "lr=fast"]) == 2
    assert "dflashkit train: error: lr: 'fast' is not a float" in capsys.readouterr().err
    assert export_main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
