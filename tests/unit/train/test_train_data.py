"""Packing, split and order of training data; the tiny target + shards builders (tests/support/) work."""

import json

import pytest
import torch

from dflashkit.train.data import epoch_order, pack_sequences, rank_slots, split_indices, steps_per_epoch


# --------------------------------------------------------------------------- tests of train/data.py
def test_pack_sequences_lays_out_one_sequence():
    ids = torch.arange(100, 110)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    hidden = torch.randn(10, 6)
    p = pack_sequences([ids], [mask], [hidden], [torch.tensor([2, 8])], block_size=4, mask_token_id=7)
    assert p.block_ids.tolist() == [[102, 7, 7, 7, 108, 7, 7, 7]]
    assert p.position_ids.tolist() == [list(range(10)) + [2, 3, 4, 5, 8, 9, 10, 11]]
    assert p.labels.tolist() == [[103, 104, 105], [109, 0, 0]]
    # anchor 2: labels at 3,4,5 all in the loss mask; anchor 8: 9 valid, 10/11 past the end
    assert p.valid.tolist() == [[True, True, True], [True, False, False]]
    assert p.teacher_index.tolist() == [[2, 3, 4], [8, 9, 9]]
    assert p.target_hidden.shape == (1, 10, 6)
    masked = pack_sequences([ids], [mask], [hidden], [torch.tensor([4])], 4, 7)
    assert masked.valid.tolist() == [[True, False, True]]  # label at 6 is outside the loss mask
    no_anchor = torch.zeros(0, dtype=torch.long)
    empty = pack_sequences([ids], [torch.zeros(10, dtype=torch.bool)], [hidden], [no_anchor], 4, 7)
    assert empty.anchors.tolist() == [0] and not empty.valid.any()


def test_split_is_fixed_and_disjoint():
    tr, ev = split_indices(50, 5, seed=1)
    assert len(ev) == 5 and not set(tr) & set(ev) and sorted(tr + ev) == list(range(50))
    assert split_indices(50, 5, seed=1) == (tr, ev) and split_indices(50, 5, seed=2)[1] != ev
    with pytest.raises(ValueError, match="eval_samples"):
        split_indices(5, 5, seed=0)


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_rank_slots_cover_each_sample_once(world, accum):
    order = epoch_order(list(range(17)), seed=0, epoch=2)
    assert sorted(order) == list(range(17))
    per_rank = [rank_slots(order, 0, world, accum, r) for r in range(world)]
    steps = steps_per_epoch(17, world, accum)
    assert all(len(s) == steps * accum for s in per_rank)  # every rank runs the same number of passes
    real = [i for s in per_rank for i, pad in s if not pad]
    assert sorted(real) == list(range(17))
    # the single-process order with accum' = world*accum visits the same samples step by step
    single = rank_slots(order, 0, 1, world * accum, 0)
    for step in range(steps):
        multi = {i for s in per_rank for i, pad in s[step * accum:(step + 1) * accum] if not pad}
        one = {i for i, pad in single[step * world * accum:(step + 1) * world * accum] if not pad}
        assert multi == one
    # resuming mid-epoch continues with the same slots
    resumed = rank_slots(order, world * accum, world, accum, 0)
    assert resumed == per_rank[0][accum:]
    with pytest.raises(ValueError, match="multiple"):
        rank_slots(order, 1, 2, 2, 0)


def test_builders_write_readable_shards(tiny_run):
    from dflashkit.extract.shards.reader import ShardDataset

    _, shards = tiny_run
    ds = ShardDataset(shards)
    assert len(ds) == 12 and ds.has_last_hidden
    s = ds[3]
    assert s["hidden"].shape == (len(s["input_ids"]), 64) and s["last_hidden"].shape[1] == 32
    assert json.loads((shards / "manifest.json").read_text())["complete"]
