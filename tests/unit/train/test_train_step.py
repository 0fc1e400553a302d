"""One packed pass over all blocks equals running the drafter block by block, as decoding does."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.train.data import pack_sequences
from dflashkit.train.drafter_pass import PassOptions, forward_blocks
from dflashkit.train.loss import LossSettings

from support.packed_blocks import Head, tiny_drafter


def per_block_loop(model, head, ids, mask, hidden, anchors, B, mask_id, gamma=7.0):
    """Each block alone: context = features of positions < anchor, positions a..a+B-1, default masks."""
    L = ids.numel()
    total, outs = 0.0, []
    for a in anchors.tolist():
        block = torch.full((1, B), mask_id)
        block[0, 0] = ids[a]
        pos = torch.cat([torch.arange(a), torch.arange(a, a + B)])[None]
        h = model(position_ids=pos, noise_embedding=head.embed(block), target_hidden=hidden[None, :a])
        outs.append(h[0])
        logits = head.lm_head(h[0, 1:])
        for k in range(1, B):
            if a + k < L and mask[a + k]:
                ce = F.cross_entropy(logits[k - 1], ids[a + k])
                total = total + math.exp(-(k - 1) / gamma) * ce
    return total, torch.stack(outs)


@pytest.mark.parametrize("layer_types,window", [(["full_attention"] * 2, None),
                                                (["sliding_attention", "full_attention"], 3)])
def test_packed_pass_equals_per_block_loop(layer_types, window):
    torch.manual_seed(0)
    V, H, B, L = 40, 32, 4, 14
    model = tiny_drafter(V, H, B, layer_types, window)
    head = Head(V, H, scale=1.5).double()
    ids = torch.randint(0, V - 1, (L,))
    mask = torch.ones(L, dtype=torch.bool)
    mask[:2] = False
    mask[9] = False
    hidden = torch.randn(L, 2 * H, dtype=torch.float64)
    anchors = torch.tensor([0, 2, 3, 7, 12])  # anchor 0 (no context), overlaps, a partial tail past the end
    batch = pack_sequences([ids], [mask], [hidden], [anchors], B, V - 1)
    h_packed = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: h_packed.update(h=o))
    out = forward_blocks(model, head, batch,
                         PassOptions(block_size=B, layer_types=layer_types, sliding_window=window,
                                     loss=LossSettings(chunk_tokens=5)))
    hook.remove()
    ref_loss, ref_hidden = per_block_loop(model, head, ids, mask, hidden, anchors, B, V - 1)
    # the drafter's RMSNorm computes in fp32 even for fp64 inputs: agreement is to ~1e-7, not fp64 precision
    torch.testing.assert_close(h_packed["h"][0].view(len(anchors), B, H), ref_hidden, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss_sum, ref_loss.detach(), rtol=1e-7, atol=1e-7)


def test_packed_gradients_equal_per_block_loop():
    torch.manual_seed(1)
    V, H, B, L = 30, 16, 3, 10
    cfg = DrafterConfig(hidden_size=H, num_target_layers=3, vocab_size=V, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, target_layer_ids=[1],
                        block_size=B, mask_token_id=0)
    model = build_drafter(cfg).double()
    head = Head(V, H).double()
    ids, mask = torch.randint(1, V, (L,)), torch.ones(L, dtype=torch.bool)
    hidden = torch.randn(L, H, dtype=torch.float64)
    anchors = torch.tensor([1, 4, 5, 8])
    out = forward_blocks(model, head, pack_sequences([ids], [mask], [hidden], [anchors], B, 0),
                         PassOptions(block_size=B, layer_types=["full_attention"], sliding_window=None,
                                     loss=LossSettings(chunk_tokens=2)))
    out.loss_sum.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref, _ = per_block_loop(model, head, ids, mask, hidden, anchors, B, 0)
    ref.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=1e-6, atol=1e-7, msg=n)
