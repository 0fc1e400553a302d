"""How many DSpark drafts to verify (drafter/dspark_schedule.py): the static threshold and the paper's load-aware
prefix scheduler (Algorithm 1), against hand-computed cases and an exhaustive search."""

import itertools
import math

import pytest
import torch

from dflashkit.drafter.dspark_schedule import confident_prefix_length, prefix_survival, schedule_verify_lengths


def logit(p):
    return math.log(p / (1 - p))


def test_the_threshold_keeps_the_drafts_before_the_first_unconfident_one():
    c = torch.tensor([[0.9, 0.8, 0.3, 0.9], [0.2, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    logits = torch.log(c / (1 - c))
    assert confident_prefix_length(logits, 0.5).tolist() == [2, 0, 4]
    assert confident_prefix_length(logits, 0.0).tolist() == [4, 4, 4]  # 0: verify every draft
    torch.testing.assert_close(prefix_survival(logits)[0], torch.tensor([0.9, 0.72, 0.216, 0.1944],
                                                                         dtype=torch.float64))


def test_free_verification_admits_every_draft_and_costly_verification_none():
    survival = prefix_survival(torch.tensor([[logit(0.9), logit(0.5)], [logit(0.6), logit(0.2)]]))
    assert schedule_verify_lengths(survival, [1.0] * 7) == [2, 2]
    # each extra token verified halves the steps per second: no draft is worth it
    assert schedule_verify_lengths(survival, [2.0 ** -b for b in range(7)]) == [0, 0]


def test_a_hand_computed_schedule():
    # a = [[0.9, 0.45], [0.6, 0.12]]; admission order 0.9 (r0), 0.6 (r1), 0.45 (r0), 0.12 (r1)
    survival = torch.tensor([[0.9, 0.45], [0.6, 0.12]], dtype=torch.float64)
    sps = [0, 0, 10.0, 9.0, 8.0, 6.0, 5.0]
    # B=2: 2*10=20; B=3: 2.9*9=26.1; B=4: 3.5*8=28; B=5: 3.95*6=23.7 (stop)
    assert schedule_verify_lengths(survival, sps) == [1, 1]


def exhaustive_best(survival, sps):
    """The best throughput over every combination of prefix lengths."""
    r, p = survival.shape
    best = None
    for lengths in itertools.product(range(p + 1), repeat=r):
        tau = sum(1 + float(survival[i, :n].sum()) for i, n in enumerate(lengths))
        value = tau * sps[r + sum(lengths)]
        best = value if best is None or value > best else best
    return best


@pytest.mark.parametrize("seed", range(6))
def test_with_a_smooth_cost_curve_the_greedy_path_finds_the_best_throughput(seed):
    g = torch.Generator().manual_seed(seed)
    survival = prefix_survival(torch.randn(3, 3, generator=g) * 2 + 1)
    sps = [1.0 / (1.0 + 0.15 * b) for b in range(13)]  # steps per second falling smoothly with the batch
    lengths = schedule_verify_lengths(survival, sps)
    tau = sum(1 + float(survival[i, :n].sum()) for i, n in enumerate(lengths))
    assert tau * sps[3 + sum(lengths)] == pytest.approx(exhaustive_best(survival, sps), rel=1e-12)


def test_a_cost_table_too_short_is_refused():
    with pytest.raises(ValueError, match="steps_per_second"):
        schedule_verify_lengths(torch.full((2, 3), 0.5, dtype=torch.float64), [1.0] * 8)
