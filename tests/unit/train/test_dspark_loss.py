"""DSpark's loss terms (train/dspark_loss.py) against the paper's formulas written out position by position, and
their gradients reaching the Markov and confidence heads through teacher-forced predecessors."""

import math

import pytest
import torch
from transformers import LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.drafter.modeling_dspark import MarkovHead, markov_greedy
from dflashkit.train.dspark_loss import (
    DSparkLossOptions,
    acceptance_rate,
    dspark_loss,
    dspark_loss_sums,
    teacher_forced_predecessors,
)


def written_out(draft, labels, valid, target, conf, opts):
    """Eqs. 8-12 of arXiv 2607.05147 one position at a time, in float64 Python arithmetic."""
    ce = l1 = bce = den = 0.0
    for i in range(draft.shape[0]):
        for k in range(draft.shape[1]):
            if not valid[i, k]:
                continue
            w = math.exp(-k / opts.gamma)  # exp(-(k-1)/gamma) for the 1-based position k+1
            pd = [math.exp(x) for x in draft[i, k].tolist()]
            pt = [math.exp(x) for x in target[i, k].tolist()]
            pd, pt = [x / sum(pd) for x in pd], [x / sum(pt) for x in pt]
            dist = sum(abs(a - b) for a, b in zip(pd, pt))
            c_star, c = 1 - dist / 2, 1 / (1 + math.exp(-float(conf[i, k])))
            ce += w * -math.log(pd[int(labels[i, k])])
            l1 += w * dist
            bce += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            den += w
    return (opts.ce_weight * ce + opts.tv_weight * l1 + opts.confidence_weight * bce) / den, (ce / den, l1 / den,
                                                                                              bce / den)


def batch(seed=0, n=3, p=4, vocab=7):
    g = torch.Generator().manual_seed(seed)
    draft, target = torch.randn(n, p, vocab, generator=g) * 2, torch.randn(n, p, vocab, generator=g) * 2
    labels = torch.randint(0, vocab, (n, p), generator=g)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return draft, labels, valid, target, torch.randn(n, p, generator=g)


@pytest.mark.parametrize("opts", [DSparkLossOptions(), DSparkLossOptions(ce_weight=1.0, tv_weight=0.3,
                                                                         confidence_weight=0.5, gamma=2.0)])
def test_the_loss_is_the_papers_weighted_sum(opts):
    draft, labels, valid, target, conf = batch()
    loss, means = dspark_loss(draft, labels, valid, opts, target, conf)
    want, (ce, l1, bce) = written_out(draft, labels, valid, target, conf, opts)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert [m.item() for m in means] == pytest.approx([ce, l1, bce], rel=1e-5)


def test_ce_alone_needs_no_target_and_an_unused_term_is_zero():
    draft, labels, valid, target, conf = batch()
    opts = DSparkLossOptions(ce_weight=1.0, tv_weight=0.0, confidence_weight=0.0)
    sums = dspark_loss_sums(draft, labels, valid, opts)
    assert sums.l1.item() == 0 and sums.confidence.item() == 0 and sums.ce.item() > 0
    with pytest.raises(ValueError, match="target_logits"):
        dspark_loss_sums(draft, labels, valid, DSparkLossOptions())
    with pytest.raises(ValueError, match="confidence_logits"):
        dspark_loss_sums(draft, labels, valid, DSparkLossOptions(), target_logits=target)


def test_acceptance_rate_is_one_minus_total_variation():
    same = torch.randn(2, 5)
    assert torch.allclose(acceptance_rate(same, same), torch.ones(2))
    disjoint = acceptance_rate(torch.tensor([[30.0, 0.0, 0.0]]), torch.tensor([[0.0, 30.0, 0.0]]))
    assert disjoint.item() == pytest.approx(0.0, abs=1e-6)


def test_teacher_forced_predecessors_are_the_anchor_then_the_labels():
    got = teacher_forced_predecessors(torch.tensor([9, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert got.tolist() == [[9, 1, 2], [8, 4, 5]]


def test_gradients_reach_both_heads_and_the_confidence_target_is_detached():
    target_config = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=11)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target_config, num_hidden_layers=1, block_size=4, mask_token_id=10,
                                   architecture="dspark", markov_rank=3)
    model = build_drafter(cfg)
    lm_head = torch.nn.Linear(16, 11, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 3, 16, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    prev = teacher_forced_predecessors(torch.tensor([4, 5]), labels)
    draft = model.block_logits(hidden, prev, lm_head)
    conf = model.confidence_logits(hidden, prev)
    valid = torch.ones(2, 3, dtype=torch.bool)
    only_conf = DSparkLossOptions(ce_weight=0.0, tv_weight=0.0, confidence_weight=1.0)
    loss, _ = dspark_loss(draft, labels, valid, only_conf, torch.randn(2, 3, 11), conf)
    loss.backward()
    # the soft label c*_k is detached: the confidence loss trains the head, never the draft distribution
    assert model.markov_head.markov_w2.weight.grad is None or not model.markov_head.markov_w2.weight.grad.any()
    assert model.confidence_head.proj.weight.grad.abs().sum() > 0
    model.zero_grad()
    draft = model.block_logits(hidden, prev, lm_head)
    loss, _ = dspark_loss(draft, labels, valid, DSparkLossOptions(confidence_weight=0.0), torch.randn(2, 3, 11))
    loss.backward()
    assert model.markov_head.markov_w2.weight.grad.abs().sum() > 0  # zero at the start, yet it learns


def test_teacher_forced_training_teaches_the_markov_head_a_block_its_drafts_keep_consistent():
    """Blocks after anchor 0 read (1, 3) or (2, 4) at random: no per-position distribution drafts them reliably
    (position 2 alone is a coin flip), a transition bias does. Trained on the backbone's flat logits with the
    teacher-forced predecessors, the greedy Markov draft continues whichever first token it picks correctly."""
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=8, rank=4)
    torch.nn.init.zeros_(head.markov_w2.weight)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.1)
    opts = DSparkLossOptions(ce_weight=1.0, tv_weight=0.0, confidence_weight=0.0)
    anchors = torch.zeros(64, dtype=torch.long)
    for _ in range(60):
        first = torch.randint(1, 3, (64,))
        labels = torch.stack([first, first + 2], dim=1)
        draft = torch.zeros(64, 2, 8) + head(teacher_forced_predecessors(anchors, labels))
        loss, _ = dspark_loss(draft, labels, torch.ones(64, 2, dtype=torch.bool), opts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        tokens = markov_greedy(torch.zeros(1, 2, 8), torch.zeros(1, dtype=torch.long), head)[0].tolist()
        assert tokens[0] in (1, 2) and tokens[1] == tokens[0] + 2
        assert head(torch.tensor([1, 2])).argmax(-1).tolist() == [3, 4]
