"""The training bar's postfix: the log line's loss and speed, and tau_sim only once a held-out evaluation gave one
(no `tau_sim=nan` before the first)."""

from dflashkit.train.trainer import bar_postfix

METRICS = {"train/loss": 2.5, "tokens_per_s": 1234.4}


def test_no_tau_sim_before_the_first_evaluation():
    assert bar_postfix(METRICS, {}) == {"loss": "2.500", "tok_s": "1234"}


def test_the_last_evaluation_s_tau_sim_after_it():
    assert bar_postfix(METRICS, {"eval/tau_sim": 2.345, "eval/loss": 1.0}) == {
        "loss": "2.500", "tau_sim": "2.35", "tok_s": "1234"}
