"""The split block attention (the context part through flex_attention or its dense twin, each block's own keys
densely, merged by log-sum-exp) equals the single masked attention element by element: outputs and gradients
(fp32), on packed sequences with several anchors, overlapping blocks, partial tails, blocks anchored at their
sequence's start (no context), padding blocks, and sliding-window layers."""

import pytest
import torch

from dflashkit.drafter.modeling_dflash import attend
from dflashkit.train.block_mask import block_tiles, build_block_masks, dense_block_mask, split_block_mask
from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.drafter_pass import PassOptions, forward_blocks
from dflashkit.train.loss import LossSettings
from dflashkit.train.objectives import loss_denominator
from dflashkit.train.recipe import load_config
from dflashkit.train.split_attention import SplitBlockMask, context_attention

from support.packed_blocks import Head, make_samples, tile_truth, tiny_drafter


def packed_layout(lens, per_seq, seed, pad_blocks=2):
    """Anchors and sequence starts (packed context indices) with, per sequence: its start (no context), its last
    position (a partial tail), random anchors (adjacent ones overlap); then padding blocks (anchor 0, start 0)."""
    g = torch.Generator().manual_seed(seed)
    anchors, starts, off = [], [], 0
    for n in lens:
        picks = torch.randperm(n, generator=g)[:per_seq].tolist() + [0, n - 1, n // 2, n // 2 + 1]
        for a in sorted(set(picks)):
            anchors.append(off + a)
            starts.append(off)
        off += n
    anchors += [0] * pad_blocks
    starts += [0] * pad_blocks
    return torch.tensor(anchors), torch.tensor(starts), off


LAYOUTS = [([9, 14, 5], 4, None), ([20, 13], 5, 3), ([7, 30, 11, 2], 6, 8), ([25], 4, 1), ([12, 18], 4, 30)]


@pytest.mark.parametrize("lens,B,window", LAYOUTS)
def test_split_equals_dense_mask_outputs_and_gradients(lens, B, window):
    anchors, starts, L = packed_layout(lens, 5, seed=B)
    L += 3  # context slack past the last sequence, as padding leaves it
    Q = anchors.numel() * B
    g = torch.Generator().manual_seed(len(lens))
    q = torch.randn(1, 4, Q, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, L + Q, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, L + Q, 8, generator=g, requires_grad=True)
    grad_out = torch.randn(1, 4, Q, 8, generator=g)
    dense = dense_block_mask(anchors, L, B, window, starts)
    assert not dense[0, 0, :, :L].any(-1).all()  # some rows see no context: the -inf branch is exercised
    ref = attend(q, k, v, dense, 0.4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    split = split_block_mask(anchors, L, B, window, starts)  # CPU: the dense context part
    assert isinstance(split, SplitBlockMask) and torch.is_tensor(split.context_mask)
    got = attend(q, k, v, split, 0.4)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", got_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("lens,B,window", [([300, 200, 140], 16, None), ([300, 200, 140], 16, 40),
                                           ([100, 37, 250], 10, 7)])
def test_context_tiles_and_flex_numbers(lens, B, window):
    """The context-only tiles are exactly the truth of the dense mask's context columns, and flex_attention over
    them (CPU eager, forward only: it has no CPU backward) returns the dense twin's output and log-sum-exp."""
    anchors, starts, L = packed_layout(lens, 40, seed=B)
    L += 128 - L % 128  # padded to a tile, as collate_blocks does
    dense = dense_block_mask(anchors, L, B, window, starts)[0, 0, :, :L]
    any_t, full_t = block_tiles(anchors, L, B, window, starts, block_keys=False)
    truth_any, truth_full = tile_truth(dense)
    assert torch.equal(any_t, truth_any) and torch.equal(full_t, truth_full)
    assert full_t.any() or window is not None
    flex = split_block_mask(anchors, L, B, window, starts, context="flex")
    twin = split_block_mask(anchors, L, B, window, starts, context="dense")
    assert type(flex.context_mask).__name__ == "BlockMask"
    g = torch.Generator().manual_seed(1)
    Q = anchors.numel() * B
    q, k, v = torch.randn(1, 4, Q, 8, generator=g), torch.randn(1, 2, L, 8, generator=g), torch.randn(1, 2, L, 8,
                                                                                                     generator=g)
    out_f, lse_f = context_attention(q, k, v, flex.context_mask, 0.3)
    out_d, lse_d = context_attention(q, k, v, twin.context_mask, 0.3)
    empty = ~dense.any(-1)
    assert empty.any() and torch.equal(torch.isinf(lse_f[0, 0]), empty) and torch.equal(torch.isinf(lse_d[0, 0]), empty)
    torch.testing.assert_close(lse_f[..., ~empty], lse_d[..., ~empty], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_f, out_d, rtol=1e-5, atol=1e-5)
    # the whole split attention with the flex context part equals the single masked attention (forward)
    kk, vv = torch.randn(2, 1, 2, L + Q, 8, generator=g)
    ref = attend(q, kk, vv, dense_block_mask(anchors, L, B, window, starts), 0.3)
    torch.testing.assert_close(attend(q, kk, vv, flex, 0.3), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_types,window", [(["full_attention"] * 2, None),
                                                (["sliding_attention", "full_attention"], 3)])
def test_drafter_pass_split_equals_dense(layer_types, window):
    """A packed micro-batch through the drafter: the same hidden states, loss and parameter gradients."""
    torch.manual_seed(0)
    V, H, B = 40, 32, 4
    model, head = tiny_drafter(V, H, B, layer_types, window).float(), Head(V, H, scale=1.5)
    samples = [{k: (t.float() if t.is_floating_point() else t) if torch.is_tensor(t) else t for k, t in s.items()}
               for s in make_samples([14, 9, 21], V, H, seed=1)]
    batch = collate_blocks(samples, CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2))
    masks = build_block_masks(batch.anchors, batch.ctx_len, B, layer_types, window, "split", batch.context_start)
    assert all(isinstance(m, SplitBlockMask) for m in (masks.values() if isinstance(masks, dict) else [masks]))
    res = {}
    for backend in ("dense", "split"):
        seen = {}
        hook = model.norm.register_forward_hook(lambda m, i, o: seen.update(h=o))
        out = forward_blocks(model, head, batch,
                             PassOptions(block_size=B, layer_types=layer_types, sliding_window=window, backend=backend,
                                         loss=LossSettings(variant="dpace", chunk_tokens=7)))
        hook.remove()
        loss = out.loss_sum / loss_denominator(batch.valid, "dpace", 7.0)
        loss.backward()
        res[backend] = (seen["h"].detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    torch.testing.assert_close(res["split"][0], res["dense"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["split"][1], res["dense"][1], rtol=1e-6, atol=1e-6)
    for n, grad in res["dense"][2].items():
        assert grad.abs().sum() > 0, n
        torch.testing.assert_close(res["split"][2][n], grad, rtol=1e-4, atol=1e-6, msg=n)


def test_config_and_builder_names():
    assert load_config(attention="split").attention == "split"
    with pytest.raises(ValueError, match="'split'"):
        load_config(attention="splt")
    with pytest.raises(ValueError, match="'split'"):
        build_block_masks(torch.tensor([1]), 4, 2, ["full_attention"], backend="sparse")
    with pytest.raises(ValueError, match="context backend"):
        split_block_mask(torch.tensor([1]), 4, 2, context="sdpa")
    mask = split_block_mask(torch.tensor([1, 2]), 4, 2)
    with pytest.raises(ValueError, match="keys must be"):
        mask.attend(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 1.0)


def test_masked_attention_runs_in_the_autocast_dtype(monkeypatch):
    """Mixed-precision training hands q and k over in float32 (RMSNorm's fp32 weight) and v in bf16. Autocast
    casts SDPA's inputs itself; flex_attention (BlockMask) and the split attention are not on its lists, so
    attend casts them: both receive bf16 q, k, v, and give what the same attention of the cast inputs gives.
    Outside autocast nothing is cast."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import dflashkit.drafter.modeling_dflash as modeling

    seen = []

    def recording_flex(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(modeling, "_FLEX", [recording_flex])
    anchors, starts, L = packed_layout([9, 14], 3, seed=1)
    Q = anchors.numel() * 4
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, Q, 8, generator=g), torch.randn(1, 2, L + Q, 8, generator=g)
    v = torch.randn(1, 2, L + Q, 8, generator=g).bfloat16()
    dense = dense_block_mask(anchors, L, 4, None, starts)
    block_mask = create_block_mask(lambda b, h, qi, kj: dense[0, 0, qi, kj], 1, 1, Q, L + Q, device="cpu",
                                   BLOCK_SIZE=16)
    split = split_block_mask(anchors, L, 4, None, starts)
    cast = (q.bfloat16(), k.bfloat16(), v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_flex = attend(q, k, v, block_mask, 0.4)
        got_split = attend(q, k, v, split, 0.4)
    assert seen == [(torch.bfloat16,) * 3] and got_flex.dtype == got_split.dtype == torch.bfloat16
    assert torch.equal(got_flex, flex_attention(*cast, block_mask=block_mask, scale=0.4, enable_gqa=True))
    assert torch.equal(got_split, split.attend(*cast, 0.4))
    seen.clear()
    attend(q, k, v.float(), block_mask, 0.4)  # no autocast: the inputs as given
    assert seen == [(torch.float32,) * 3]
