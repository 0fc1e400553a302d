"""Random inputs of the attention kernels (the slot generator's decode attention, eval's tree attention) and the
masked reference the decode kernel is compared with. Shared by the tests and by the scripts they run under the
Triton interpreter (support/triton_interpreter.py), which import them from here."""

import torch

from dflashkit.eval.tree import ancestor_mask, build_tree
from dflashkit.extract.generation.slot_cache import grouped_attention


def decode_case(seed=0, slots=5, hkv=2, group=3, d=24, columns=70, dtype=torch.float32):
    """Random query and a cache slice [:, :, :columns] of a longer cache; ragged positions with 0 and the last
    column among them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(slots, hkv * group, 1, d, generator=g).to(dtype)
    k = torch.randn(slots, hkv, columns + 9, d, generator=g).to(dtype)[:, :, :columns]
    v = torch.randn(slots, hkv, columns + 9, d, generator=g).to(dtype)[:, :, :columns]
    positions = torch.randint(0, columns, (slots,), generator=g)
    positions[0], positions[-1] = 0, columns - 1
    return q, k, v, positions


def masked_grouped(q, k, v, positions, scale, window=None):
    """What the generator's SDPA path computes: an additive mask over the columns and grouped_attention."""
    cols = torch.arange(k.shape[2])[None, :]
    visible = cols <= positions[:, None]
    if window:
        visible &= cols > positions[:, None] - window
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))[:, None, None, :]
    return grouped_attention(None, q, k, v, mask, scaling=scale)[0]


def tree_case(seed=0, b=2, hkv=2, group=3, n=7, d=24, slots=80, prefixes=(33, 50)):
    """A random best-first tree of ``n`` nodes after prefixes of the given lengths, with random q, k, v:
    (q, k, v, prefix lengths, ancestor mask, node positions, parents)."""
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(3, torch.randn(5, 11, generator=g), n, 3)
    parents = torch.tensor(tree.parents)
    prefix = torch.tensor(prefixes)
    positions = prefix[:, None] + torch.tensor(tree.depths)[None]
    q = torch.randn(b, hkv * group, n, d, generator=g)
    k = torch.randn(b, hkv, slots, d, generator=g)
    v = torch.randn(b, hkv, slots, d, generator=g)
    return q, k, v, prefix, ancestor_mask(parents).unsqueeze(0), positions, parents
