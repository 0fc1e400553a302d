"""Partial reports: --time-limit, SIGTERM and Ctrl-C (SIGINT) finish the current prompt, write report.json /
report.md / plots for the prompts done, marked partial, and exit non-zero. Deterministic: the time limit is 0
(checked after each prompt), and the signals arrive while the process sits at a test-only pause point."""

import json
import signal
import sys

import pytest
import transformers as tf

from dflashkit.eval.__main__ import main

from support.chat_data import save_tiny_chat_target
from support.processes import run_until_paused

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """root: a tiny random Llama with the testbed's tokenizer in root/target and a random 1-layer drafter export
    for it (block 4, mask token 0) in root/drafter (tests/unit/eval/conftest.py's pair, without the tokenizer)."""
    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    root = tmp_path_factory.mktemp("eval_partial")
    target = save_tiny_chat_target(root / "target", seed=0)
    config = tf.AutoConfig.from_pretrained(target)
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4, mask_token_id=0))
    save_drafter(drafter, root / "drafter")
    return root


def _args(root, out):
    return ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dataset", "builtin:mtbench",
            "builtin:humaneval", "--num-prompts", "2", "--max-new-tokens", "4", "--no-stop", "--out", str(out)]


def _check_partial(out, reason: str, done: int):
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] == {"reason": reason, "prompts_done": done, "prompts_planned": 4}
    assert report["overall"]["prompts"] == done and report["overall"]["lossless"]["prompts"] == done
    assert "(PARTIAL)" in (out / "report.md").read_text()
    assert (out / "acceptance_histogram.png").stat().st_size > 0
    return report


def test_time_limit_zero_stops_after_one_prompt(chat_pair, tmp_path, capsys):
    root = chat_pair
    assert main(_args(root, tmp_path / "r") + ["--time-limit", "0"]) == 1
    report = _check_partial(tmp_path / "r", "time limit 0 s", 1)
    assert list(report["datasets"]) == ["builtin:mtbench"]
    assert "partial report of 1 of 4 prompts" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_finishes_the_prompt_and_writes_a_partial_report(chat_pair, tmp_path, sig):
    root = chat_pair
    out = tmp_path / "r"
    # held at the start of the third prompt (the first of HumanEval): two prompts are done by then
    proc = run_until_paused([sys.executable, "-m", "dflashkit.eval", *_args(root, out)], "eval.prompt.2",
                            tmp_path / "paused")
    proc.send_signal(sig)
    assert proc.wait(timeout=300) == 1, proc.stderr.read().decode()[-2000:]
    report = _check_partial(out, sig.name, 3)  # the prompt it was on was finished
    assert report["datasets"]["builtin:humaneval"]["prompts"] == 1


def test_signal_after_the_last_prompt_still_writes_the_whole_report(chat_pair, tmp_path):
    """A time limit's SIGINT that lands once every prompt is done (while the report is built and its plots drawn)
    used to raise KeyboardInterrupt and lose the whole measurement; now the report is written in full."""
    root = chat_pair
    out = tmp_path / "r"
    proc = run_until_paused([sys.executable, "-m", "dflashkit.eval", *_args(root, out)], "eval.report",
                            tmp_path / "paused")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert "partial" not in report and report["overall"]["prompts"] == 4
    assert report["overall"]["lossless"]["prompts"] == 4 and report["plots"]
    assert (out / "acceptance_histogram.png").stat().st_size > 0
    assert "SIGINT while the report was written" in proc.stderr.read().decode()


def test_time_limit_after_the_last_prompt_is_a_whole_report(chat_pair, tmp_path, capsys):
    """A time limit that passes during the only prompt planned left nothing out: the report used to say
    "(PARTIAL) ... 1 of 1 prompts" and the command exit 1."""
    root = chat_pair
    args = ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dataset", "builtin:mtbench",
            "--num-prompts", "1", "--max-new-tokens", "4", "--no-stop", "--out", str(tmp_path / "r"),
            "--time-limit", "0"]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert "partial" not in report and report["overall"]["prompts"] == 1
    assert "PARTIAL" not in (tmp_path / "r" / "report.md").read_text()
