"""The runtime's sampling module against the copy that drafter/modeling_dflash.py keeps (it ships inside exports and
imports nothing of dflashkit): the same filtered distributions and the same acceptance decisions and tokens for the
same logits and seeds; and the runtime's draw follows its distribution."""

import pytest
import torch

from dflashkit.drafter import modeling_dflash
from dflashkit.targets.runtime.sampling import sample_next, sampled_accept_chain, sampling_probs

SETTINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.8, 0.6, 20), (1.0, 0.05, 0), (0.5, 0.95, 40)]


@pytest.mark.parametrize("temperature, top_p, top_k", SETTINGS)
def test_the_shipped_filter_equals_the_runtimes(temperature, top_p, top_k):
    for seed in range(5):
        logits = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(seed)) * 4
        ours = sampling_probs(logits, temperature, top_p, top_k)
        shipped = modeling_dflash._probs(logits, temperature, top_p, top_k)
        assert torch.equal(ours, shipped), (seed, temperature, top_p, top_k)
        assert torch.allclose(ours.sum(-1), torch.ones(1, 6))
        if top_k:
            assert ((ours > 0).sum(-1) <= top_k).all()


def test_the_shipped_greedy_pick_equals_the_runtimes():
    logits = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(modeling_dflash._sample(logits, 0.0, 1.0, 0), sample_next(logits, 0.0))


def _distributions(seed: int, num_drafts: int, vocab: int, close: bool):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(num_drafts + 1, vocab, generator=g) * 2, -1)
    draft = target[:num_drafts] if close else torch.softmax(torch.randn(num_drafts, vocab, generator=g) * 2, -1)
    if close:  # near the target's: most rounds accept several drafts, some every one
        draft = torch.softmax(draft.log() + 0.3 * torch.randn(num_drafts, vocab, generator=g), -1)
    tokens = torch.multinomial(draft, 1, generator=g)[:, 0]
    return tokens, draft, target


@pytest.mark.parametrize("close", [False, True])
def test_the_shipped_rejection_rule_equals_the_runtimes(close):
    accepted_counts = set()
    for seed in range(60):
        tokens, draft, target = _distributions(seed, 5, 16, close)
        torch.manual_seed(1000 + seed)
        ours = sampled_accept_chain(tokens, draft, target)
        torch.manual_seed(1000 + seed)
        shipped_accepted, shipped_token = modeling_dflash._rejection(tokens[None], target[None], draft[None])
        assert ours == (shipped_accepted, int(shipped_token)), seed
        accepted_counts.add(ours[0])
    assert len(accepted_counts) >= 3  # rejections at several depths were compared, not one case
    if close:
        assert 5 in accepted_counts  # and the all-accepted case, whose token is the bonus


def test_the_draw_follows_the_filtered_distribution():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(4)) * 2
    probs = sampling_probs(logits, 0.8, 0.9, 6)[0].double()
    torch.manual_seed(0)
    draws = sample_next(logits.expand(20000, -1), 0.8, top_p=0.9, top_k=6)
    counts = torch.bincount(draws, minlength=12).double() / draws.numel()
    assert (counts[probs == 0] == 0).all()  # a filtered-out token is never drawn
    assert 0.5 * (counts - probs).abs().sum() < 0.02  # total variation (binomial noise ~0.005)
