"""The packed block mask equals an element-by-element reference, and flex_attention gives SDPA's numbers."""

import pytest
import torch

from dflashkit.train.anchors import anchor_candidates, eval_anchors, sample_anchors, sample_generator
from dflashkit.train.block_mask import build_block_masks, dense_block_mask, flex_block_mask


def loop_reference(anchors, L, B, window=None):
    """Written from the rules, one (query, key) pair at a time."""
    n_q = len(anchors) * B
    out = torch.zeros(n_q, L + n_q, dtype=torch.bool)
    for n, a in enumerate(anchors):
        for i in range(B):
            qpos = a + i  # absolute position of the query
            for j in range(L):  # context key at absolute position j
                ok = j < a
                if window is not None:
                    ok = ok and j <= qpos and qpos - j < window
                out[n * B + i, j] = ok
            for m in range(len(anchors)):
                for k in range(B):
                    kpos = anchors[m] + k
                    ok = m == n
                    if window is not None:
                        ok = ok and kpos <= qpos and qpos - kpos < window
                    out[n * B + i, L + m * B + k] = ok
    return out


CASES = [
    ([0], 10, 4, None),                      # anchor at 0: no context at all
    ([0, 9], 10, 4, None),                   # anchor at the last position: a partial tail past the end
    ([2, 3, 4], 12, 5, None),                # overlapping blocks
    ([0, 5, 6, 17], 20, 4, 3),               # sliding window smaller than the block
    ([1, 7, 8, 15, 19], 20, 6, 8),           # sliding window larger than the block, overlaps, tail
    ([3, 10], 16, 4, 1),                     # window 1: only the query's own position
]


@pytest.mark.parametrize("anchors,L,B,window", CASES)
def test_dense_mask_equals_element_loop(anchors, L, B, window):
    got = dense_block_mask(torch.tensor(anchors), L, B, window)
    assert got.shape == (1, 1, len(anchors) * B, L + len(anchors) * B)
    ref = loop_reference(anchors, L, B, window)
    assert torch.equal(got[0, 0], ref)


def test_mask_spot_values():
    # anchor 5, block 4, L 8: query (block 0, pos 2) sees context 0..4 and the whole block, not context 5..7
    m = dense_block_mask(torch.tensor([5]), 8, 4)[0, 0]
    assert m[2, :5].all() and not m[2, 5:8].any() and m[2, 8:].all()
    # with window 3 the same query (absolute 7) sees context 5? no (j < a); context 4? no (7-4 = 3); block 0..2
    s = dense_block_mask(torch.tensor([5]), 8, 4, 3)[0, 0]
    assert s[2].nonzero().flatten().tolist() == [8, 9, 10]
    assert s[0].nonzero().flatten().tolist() == [3, 4, 8]


@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_mask_gives_dense_numbers(window):
    anchors = torch.tensor([0, 3, 4, 20, 29])
    L, B = 30, 4
    dense = dense_block_mask(anchors, L, B, window)
    flex = flex_block_mask(anchors, L, B, window)
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 20, 8, generator=g)
    k = torch.randn(1, 2, 50, 8, generator=g)
    v = torch.randn(1, 2, 50, 8, generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    got = flex_attention(q, k, v, block_mask=flex)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_build_block_masks_per_layer_type():
    a = torch.tensor([2, 6])
    one = build_block_masks(a, 10, 4, ["full_attention"] * 3)
    assert isinstance(one, torch.Tensor)
    both = build_block_masks(a, 10, 4, ["sliding_attention", "full_attention"], sliding_window=3)
    assert set(both) == {"full_attention", "sliding_attention"}
    assert torch.equal(both["sliding_attention"][0, 0], loop_reference([2, 6], 10, 4, 3))
    with pytest.raises(ValueError, match="sliding_window"):
        build_block_masks(a, 10, 4, ["sliding_attention"])


@pytest.mark.parametrize("backend", ["dense", "flex", "split"])
def test_a_causal_in_block_drafter_sees_its_whole_context_and_the_block_up_to_itself(backend):
    """causal=True: the full-attention layers' rule becomes context j < a (every earlier token of the sequence)
    and block key k <= query i, written here from that rule; every backend computes the same attention."""
    anchors, L, B = [0, 3, 9, 13], 16, 4
    rule = torch.zeros(len(anchors) * B, L + len(anchors) * B, dtype=torch.bool)
    for n, a in enumerate(anchors):
        for i in range(B):
            rule[n * B + i, :a] = True
            rule[n * B + i, L + n * B:L + n * B + i + 1] = True
    a = torch.tensor(anchors)
    dense = build_block_masks(a, L, B, ["full_attention"], causal=True)
    assert torch.equal(dense[0, 0], rule)
    assert not torch.equal(build_block_masks(a, L, B, ["full_attention"])[0, 0], rule)  # the default is not causal
    mixed = build_block_masks(a, L, B, ["sliding_attention", "full_attention"], sliding_window=3, causal=True)
    assert torch.equal(mixed["full_attention"][0, 0], rule)
    assert torch.equal(mixed["sliding_attention"][0, 0], loop_reference(anchors, L, B, 3))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (len(anchors) * B, L + len(anchors) * B,
                                                             L + len(anchors) * B))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rule[None, None])
    mask = build_block_masks(a, L, B, ["full_attention"], backend=backend, causal=True)
    if backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        got = flex_attention(q, k, v, block_mask=mask)
    elif backend == "split":
        got = mask.attend(q, k, v, scale=8 ** -0.5)  # SDPA's default scale for head dim 8
    else:
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_anchor_candidates_and_sampling():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert anchor_candidates(mask).tolist() == [1, 2, 5]  # p with mask[p] and mask[p+1]; never the last token
    assert sample_anchors(mask, 512).tolist() == [1, 2, 5]  # fewer than asked: all of them
    long = torch.ones(100, dtype=torch.bool)
    a = sample_anchors(long, 10, sample_generator(0, 1, 2))
    assert a.numel() == 10 and a.unique().numel() == 10 and torch.equal(a, a.sort().values)
    assert a.max() <= 98
    b = sample_anchors(long, 10, sample_generator(0, 1, 2))
    c = sample_anchors(long, 10, sample_generator(0, 1, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # without replacement and uniform: every candidate is drawn about equally often
    counts = torch.zeros(100)
    for s in range(400):
        counts[sample_anchors(long, 10, sample_generator(s, 0, 0))] += 1
    assert counts[99] == 0 and counts[:99].min() > 15 and counts[:99].max() < 70


def test_eval_anchors_fixed_and_inside_span():
    mask = torch.zeros(60, dtype=torch.bool)
    mask[10:40] = True
    a = eval_anchors(mask, 8, 5, seed=3, sample_index=7)
    assert torch.equal(a, eval_anchors(mask, 8, 5, seed=3, sample_index=7))
    assert a.numel() == 5 and ((a >= 10) & (a + 7 <= 39)).all()  # whole block inside the trained span
    short = torch.zeros(20, dtype=torch.bool)
    short[4:7] = True  # no full block fits: falls back to the training candidates
    assert eval_anchors(short, 8, 5, seed=3, sample_index=7).tolist() == [4, 5]
