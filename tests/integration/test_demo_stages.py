"""`dflashkit demo`: the stages call the library functions of the user-facing commands with explicit keyword
arguments, and a second run resumes after the last finished stage (here all are finished, so nothing runs and the
summary comes from the reports)."""

import inspect
import json

import pytest

from dflashkit.demo import SCALES, main, stage_calls
from dflashkit.errors import UserError


def test_stage_calls_chain_the_run_directory(tmp_path):
    stages = {name: kwargs for name, _, kwargs in stage_calls(tmp_path, SCALES["small"], "cpu", "kl")}
    assert list(stages) == ["regenerate", "extract", "train", "eval-chain", "eval-tree"]
    assert stages["extract"]["data"] == [stages["regenerate"]["out"]] == [str(tmp_path / "regen.jsonl")]
    assert stages["extract"]["store_last_hidden"]  # the kl objective needs the target's last hidden states
    assert stages["train"]["shards"] == stages["extract"]["out"] == str(tmp_path / "shards")
    assert stages["train"]["mask_token_id"] == 16 and stages["train"]["loss"] == "kl"
    for mode in ("eval-chain", "eval-tree"):
        assert stages[mode]["drafter"] == stages["train"]["export_dir"] == str(tmp_path / "drafter")
    full = {name: kwargs for name, _, kwargs in stage_calls(tmp_path, SCALES["full"], "cuda", None)}
    assert full["eval-tree"]["num_prompts"] is None and full["eval-tree"]["baseline_prompts"] == 10  # all prompts
    assert full["train"]["epochs"] == 3 and "loss" not in full["train"] and "mixed_precision" not in full["train"]


def test_every_keyword_is_a_parameter_of_its_library_function(tmp_path):
    from dflashkit.demo import evaluate
    from dflashkit.eval.options import EvalOptions
    from dflashkit.extract.options import ExtractOptions, RegenerateOptions
    from dflashkit.train.recipe import load_config

    def binds(function, kwargs, partial=False):
        signature = inspect.signature(function)
        (signature.bind_partial if partial else signature.bind)(**kwargs)  # TypeError names a wrong keyword

    for scale in SCALES.values():
        for name, _, kwargs in stage_calls(tmp_path, scale, "cpu", "kl"):
            if name == "train":
                fields = dict(kwargs)
                assert load_config(fields.pop("recipe"), (), **fields).export_dir == str(tmp_path / "drafter")
            elif name.startswith("eval"):  # demo's evaluate takes a few, the options of run_eval the rest
                own = set(inspect.signature(evaluate).parameters) - {"kwargs"}
                binds(evaluate, kwargs)
                binds(EvalOptions, {k: v for k, v in kwargs.items() if k not in own}, partial=True)
            else:
                binds({"regenerate": RegenerateOptions, "extract": ExtractOptions}[name], kwargs)  # their flags
    with pytest.raises(TypeError, match="num_prompt"):
        binds(EvalOptions, {"num_prompt": 3}, partial=True)


def test_finished_stages_are_skipped_and_summarised(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    for name in ("regenerate", "extract", "train", "eval-chain", "eval-tree"):
        (run / "stages" / f"{name}.json").write_text(json.dumps({"command": [], "seconds": 1.5}))
    for mode, tau in (("chain", 2.5), ("tree", 3.25)):
        (run / f"eval-{mode}").mkdir()
        (run / f"eval-{mode}" / "report.json").write_text(json.dumps({"overall": {
            "tau": tau, "rounds": 10, "speedup": 1.5, "verify_over_ar_step": 1.1,
            "per_position_acceptance": [0.9, 0.5]}}))
    assert main(["--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count("done already") == 5
    assert "| chain | 2.50 | 10 | 1.50 | 1.10 | 0.90 0.50 |" in out
    assert "| tree | 3.25 |" in out


def test_the_demo_plans_enough_optimizer_steps_to_learn(tmp_path):
    """`make demo` trains on the ~60 conversations its regeneration stage leaves (69 usable of 96 prompts on the
    testbed, 8 held out): its recipe must plan at least 40 optimizer steps for them (packed 4096-token micro-batches
    planned 2, and the drafter learned nothing), also if only half as many conversations survived regeneration.
    The planning is the trainer's own: split, epoch order, packing, steps per epoch."""
    from dflashkit.train.data import epoch_order, pack_order, split_indices, steps_per_epoch
    from dflashkit.train.recipe import load_config

    fields = dict(next(kwargs for name, _, kwargs in stage_calls(tmp_path, SCALES["small"], "cpu", None)
                       if name == "train"))
    cfg = load_config(fields.pop("recipe"), (), **fields)
    for usable in (69, 35):
        lengths = [145] * usable  # the demo's answers: ~145 tokens each (96 new tokens + the prompt)
        train_idx, _ = split_indices(usable, cfg.eval_samples, cfg.seed)
        planned = sum(steps_per_epoch(len(pack_order(epoch_order(train_idx, cfg.seed, e), lengths,
                                                     cfg.micro_batch_tokens, cfg.max_length)), 1, cfg.grad_accum)
                      for e in range(cfg.epochs))
        assert planned >= 40, (usable, planned)
    assert cfg.num_hidden_layers == 1 and cfg.num_anchors <= 64  # what keeps the CPU stage at a few minutes


def test_a_stage_finished_with_other_settings_is_not_reused(tmp_path):
    """A run directory left by the CPU check is not taken as done by a GPU-scale demo (or the other way)."""
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    (run / "stages" / "regenerate.json").write_text(json.dumps({"call": "regenerate", "seconds": 1.0,
                                                                "kwargs": {"device": "cuda"}}))
    with pytest.raises(UserError, match="its stage regenerate ran with other settings.*--restart"):
        main(["--run-dir", str(run), "--device", "cpu", "--scale", "small"])
