"""`dflashkit demo`: the stages call the library functions of the user-facing commands with explicit keyword
arguments, and a second run resumes after the last finished stage (here all are finished, so nothing runs and the
summary comes from the reports)."""

import json

import pytest

from dflashkit.demo import SCALES, _with_parser_defaults, main, stage_calls


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


def test_every_keyword_is_a_parameter_of_its_command(tmp_path):
    from dflashkit.eval.__main__ import build_parser as eval_parser
    from dflashkit.extract.__main__ import build_parser as extract_parser
    from dflashkit.extract.regenerate import build_parser as regenerate_parser
    from dflashkit.train.config import load_config

    parsers = {"regenerate": regenerate_parser, "extract": extract_parser, "eval-chain": eval_parser,
               "eval-tree": eval_parser}
    for scale in SCALES.values():
        for name, _, kwargs in stage_calls(tmp_path, scale, "cpu", "kl"):
            if name == "train":
                fields = dict(kwargs)
                assert load_config(fields.pop("recipe"), (), **fields).export_dir == str(tmp_path / "drafter")
            else:
                params = vars(_with_parser_defaults(parsers[name], **kwargs))
                assert all(params[k] == v for k, v in kwargs.items())
    with pytest.raises(TypeError, match=r"no parameter\(s\) \['num_prompt'\]"):
        _with_parser_defaults(eval_parser, num_prompt=3)


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
