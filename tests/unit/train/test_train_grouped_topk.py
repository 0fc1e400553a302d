"""train/loss.grouped_topk: the selector candidates' top-k, found among the row's best groups, is torch.topk's."""

import pytest
import torch

from dflashkit.train.loss import TOPK_GROUP, block_loss, grouped_topk


def check(x: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = grouped_topk(x, k, group)
    ref = torch.topk(x, k, dim=-1)
    assert torch.equal(values, ref.values)  # the same values, largest first
    assert torch.equal(x.gather(1, ids), values)  # the ids point at them
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct columns a row
    return values, ids


@pytest.mark.parametrize("cols", [4096, 4096 + 77])  # a multiple of the group, and a tail
def test_distinct_logits_give_torch_topk_values_and_ids(cols):
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(0))
    _, ids = check(x, 16, 32)
    assert torch.equal(ids, torch.topk(x, 16, dim=-1).indices)  # no ties: the same ids too


def test_the_top_values_crowded_in_one_group_or_in_the_tail():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))  # 31 groups of 32 and a tail of 8
    x[0, 64:68] += 100.0  # all 4 in one group
    x[1, 995:1000] += 100.0  # the 4 largest in the tail past the last whole group
    x[2, ::32] += 100.0  # one in each group and in the tail: the group maxima all close
    check(x, 4, 32)


def test_ties_keep_the_values_and_distinct_ids():
    """bf16 logits of a few distinct values: many ties inside and across groups."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (32, 2048), generator=g).to(torch.bfloat16)
    check(x, 16, 16)


def test_short_rows_use_torch_topk_whole():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    values, ids = grouped_topk(x, 16, 32)  # 9 groups < 4k: the whole row
    ref = torch.topk(x, 16, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)


def test_the_loss_pass_candidates_over_a_grouped_vocabulary():
    """block_loss(top_k) on a vocabulary of whole groups and a tail: the candidates are the logits' top_k."""
    g = torch.Generator().manual_seed(4)
    vocab = 16 * TOPK_GROUP + 40
    hidden, weight = torch.randn(6, 3, 8, generator=g), torch.randn(vocab, 8, generator=g)
    labels, valid = torch.randint(0, vocab, (6, 3), generator=g), torch.ones(6, 3, dtype=torch.bool)
    out = block_loss(hidden, weight, labels, valid, top_k=4, chunk_tokens=9)
    top = torch.topk(hidden @ weight.T, 4, dim=-1)
    torch.testing.assert_close(out.top_logits, top.values)
    assert torch.equal(out.top_ids, top.indices)
