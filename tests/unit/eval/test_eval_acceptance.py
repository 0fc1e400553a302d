"""The acceptance rule (greedy on trees, speculative sampling on chains) and the draft-tree builder."""

import itertools
import math

import torch

from dflashkit.eval.acceptance import greedy_accept
from dflashkit.eval.tree import DraftTree, ancestor_mask, build_tree
from dflashkit.targets.runtime.sampling import sampled_accept_chain


def test_greedy_accept_walks_the_tree():
    #        0(root=7)
    #      /     \
    #   1(3)     2(4)
    #   /  \       \
    # 3(5) 4(6)    5(1)
    tokens, parents = [7, 3, 4, 5, 6, 1], [-1, 0, 0, 1, 1, 2]
    # target wants 4 after the root, then 1, then 9 (not drafted) -> path 0-2-5, bonus 9
    assert greedy_accept(tokens, parents, [4, 0, 1, 0, 0, 9]) == ([0, 2, 5], 9)
    # target wants something never drafted at the root -> only the bonus
    assert greedy_accept(tokens, parents, [8, 5, 1, 0, 0, 9]) == ([0], 8)
    # a chain: the usual leading-match rule
    chain = DraftTree.chain(7, [3, 5, 2])
    assert greedy_accept(chain.tokens, chain.parents, [3, 5, 0, 4]) == ([0, 1, 2], 0)
    assert greedy_accept(chain.tokens, chain.parents, [3, 5, 2, 4]) == ([0, 1, 2, 3], 4)


def test_speculative_sampling_is_lossless():
    """Emitted tokens follow the target: the first one ~ p0, the second (given a kept first draft) ~ p1."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 4, 6000
    target = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    kept_first = 0
    accepted_lengths = []
    for _ in range(trials):
        drafts = torch.multinomial(draft, 1, generator=g)[:, 0]
        accepted, nxt = sampled_accept_chain(drafts, draft, target, g)
        emitted = [*drafts[:accepted].tolist(), nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
            kept_first += 1
        accepted_lengths.append(accepted)
    for counts, p, n in ((first, target[0], trials), (second, target[1], kept_first)):
        tolerance = 4 * torch.sqrt(p * (1 - p) / n) + 1e-3
        assert torch.all((counts / n - p).abs() <= tolerance), (counts / n, p)
    # the first draft is kept with probability sum_x min(p0, q0)
    expected = torch.minimum(target[0], draft[0]).sum().item()
    rate = sum(a >= 1 for a in accepted_lengths) / trials
    assert abs(rate - expected) <= 4 * math.sqrt(expected * (1 - expected) / trials)


def _brute_force_tree_scores(log_probs: torch.Tensor, budget: int, top_k: int) -> list[float]:
    """All paths over the per-position top-k; the best budget-1 scores (ties are impossible with random logits)."""
    depth, _ = log_probs.shape
    top = log_probs.topk(top_k, dim=-1).values.tolist()
    scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            scores.append(sum(top[i][r] for i, r in enumerate(ranks)))
    return sorted(scores, reverse=True)[: budget - 1]


def test_build_tree_is_best_first_and_well_formed():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=g) * 2
    for budget, top_k in ((1, 3), (6, 2), (20, 3), (200, 2)):
        tree = build_tree(5, logits, budget, top_k)
        assert tree.tokens[0] == 5 and tree.parents[0] == -1 and tree.depths[0] == 0
        expected = _brute_force_tree_scores(torch.log_softmax(logits, -1), budget, top_k)
        assert len(tree.scores) - 1 == len(expected)
        got = sorted(tree.scores[1:], reverse=True)
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, expected)), (got, expected)
        for node in range(1, tree.num_nodes):
            parent = tree.parents[node]
            assert 0 <= parent < node and tree.depths[node] == tree.depths[parent] + 1
            siblings = [tree.tokens[c] for c in range(1, tree.num_nodes) if tree.parents[c] == parent]
            assert len(siblings) == len(set(siblings)) <= top_k
            assert tree.tokens[node] in logits[tree.depths[node] - 1].topk(top_k).indices.tolist()


def test_top1_tree_is_the_argmax_chain():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(2))
    tree = build_tree(3, logits, budget=6, top_k=1)
    assert tree.is_chain() and tree.tokens == [3, *logits.argmax(-1).tolist()]
    assert build_tree(3, logits, budget=3, top_k=1).tokens == [3, *logits.argmax(-1).tolist()[:2]]


def test_ancestor_mask_matches_walking_parents():
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 0]
    mask = ancestor_mask(torch.tensor(parents))
    for i in range(len(parents)):
        expected, node = set(), i
        while node >= 0:
            expected.add(node)
            node = parents[node]
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected
    assert torch.equal(ancestor_mask(torch.tensor(parents), max_depth=4), mask)
    batched = ancestor_mask(torch.tensor([parents, list(range(-1, len(parents) - 1))]))
    assert torch.equal(batched[0], mask) and torch.equal(batched[1], torch.ones_like(mask).tril())


def test_ancestor_mask_of_deep_random_trees():
    """Pointer doubling takes log2(depth) steps: deep trees (depth up to 40) against a walk up the parents."""
    generator = torch.Generator().manual_seed(3)
    for n in (2, 17, 64):
        parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=generator)) for i in range(1, n)]
        mask = ancestor_mask(torch.tensor(parents))
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        assert torch.equal(ancestor_mask(torch.tensor(parents), max_depth=max(depth)), mask)
        for i in range(n):
            expected, node = set(), i
            while node >= 0:
                expected.add(node)
                node = parents[node]
            assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected
