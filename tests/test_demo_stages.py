"""`dflashkit demo`: the stage commands are the user-facing ones, and a second run resumes after the last
finished stage (here all are finished, so nothing runs and the summary comes from the reports)."""

import json

from dflashkit.demo import SCALES, main, stage_commands


def test_stage_commands_chain_the_run_directory(tmp_path):
    stages = dict(stage_commands(tmp_path, SCALES["small"], "cpu", "kl"))
    assert list(stages) == ["regenerate", "extract", "train", "eval-chain", "eval-tree"]
    assert stages["extract"][stages["extract"].index("--data") + 1] == str(tmp_path / "regen.jsonl")
    assert "--store-last-hidden" in stages["extract"]  # the kl objective needs the target's last hidden states
    assert stages["train"][stages["train"].index("--shards") + 1] == str(tmp_path / "shards")
    for mode in ("eval-chain", "eval-tree"):
        assert stages[mode][stages[mode].index("--drafter") + 1] == str(tmp_path / "drafter")
    assert "mask_token_id=16" in stages["train"]


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
