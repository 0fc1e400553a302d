"""The attention mask of one packed training pass: N blocks of B tokens against a context of L tokens that may
hold several sequences.

Keys are laid out as ``[L context tokens, then N*B block tokens]``; queries are the N*B block tokens. Query
``q = n*B + i`` is position i of block n. ``anchors[n]`` is the block's anchor as an index into the packed
context, and ``context_start[n]`` the index where the block's own sequence starts there (0 for one sequence).

Rules (the same ones decoding applies one block at a time):
- full-attention layers: block n sees context indices ``context_start[n] <= j < anchors[n]`` (its own sequence,
  strictly before its anchor) and every token of its own block (bidirectional); never another block, never
  another sequence.
- sliding-attention layers (window W): as full, plus the reference's decode-time rule, which is causal over the
  absolute position with a window: query at ``a + i`` may see key at ``j`` iff ``j <= a + i`` and
  ``a + i - j < W``. Inside the block that is ``k <= i`` and ``i - k < W``. (Both sides are shifted by the same
  sequence offset, so packed indices give the same answer as positions within the sequence.)

Design choices:
- One predicate (``block_mask_mod``) is the single source of truth. The CPU path evaluates it on a broadcast
  index grid into a dense bool mask for SDPA. The CUDA path builds a flex_attention ``BlockMask`` whose tiles
  come from the rules in closed form (every query sees at most two key intervals: part of its sequence's
  context and part of its block), in O(blocks x key tiles) tensor work with no host sync; the predicate is
  applied inside the partial tiles. ``create_block_mask`` would evaluate the predicate on all
  ``N*B x (L + N*B)`` pairs, which a packed micro-batch makes far too large. Tests compare both paths, and the
  tiles with ``create_block_mask``'s, against an element-by-element loop.
- Anchors may overlap (blocks of nearby anchors cover the same positions) and a block may run past the end of
  its sequence (a partial tail): the mask only depends on the anchor, so neither needs a special case.
- A padding block (``anchors[n] == context_start[n]``) sees only its own block: no query row is ever empty.
- Causal-in-block drafters (``DrafterConfig.causal``): full-attention layers see their whole context and are
  causal inside the block. That is the sliding rule with a window no sequence reaches (``CAUSAL_WINDOW``), so
  every backend below builds it through the sliding-window path that its tests already cover.
- A model with both layer types gets a dict ``{"full_attention": mask, "sliding_attention": mask}``.
- The "split" backend (train/split_attention.py) attends to the context and to the block separately; its
  mask (``split_block_mask``) is built here, its context part from the same tiles with the block keys left out
  (``block_keys=False``); split_attention.py holds only the attention arithmetic and imports nothing from here.
"""

from __future__ import annotations

from typing import Callable

import torch

from dflashkit.drafter.modeling_dflash import FLEX_TILE

from .split_attention import SplitBlockMask

TILE = FLEX_TILE  # flex_attention's tile (BlockMask BLOCK_SIZE) on both axes, the drafter's one constant
CAUSAL_WINDOW = 1 << 30  # the window of a causal-in-block full-attention layer: longer than any context + block


def block_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None,
                   context_start: torch.Tensor | None = None) -> Callable:
    """The predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (flex_attention's signature)."""
    L, B = int(ctx_len), int(block_size)
    W = None if sliding_window is None else int(sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // B
        i = q_idx - n * B
        a = anchors[n]
        is_ctx = kv_idx < L
        rel = kv_idx - L                      # block-key index (negative for context keys; masked below)
        m = torch.div(rel, B, rounding_mode="floor")
        k = rel - m * B
        ctx_ok = kv_idx < a
        if context_start is not None:
            ctx_ok = ctx_ok & (kv_idx >= context_start[n])
        blk_ok = m == n
        if W is not None:
            ctx_ok = ctx_ok & (a + i - kv_idx < W)
            blk_ok = blk_ok & (k <= i) & (i - k < W)
        return torch.where(is_ctx, ctx_ok, blk_ok)

    return mask_mod


def dense_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None,
                     context_start: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask ``[1, 1, N*B, L + N*B]`` (True = may attend) for SDPA."""
    anchors = anchors.reshape(-1).long()
    q_len = anchors.numel() * block_size
    q = torch.arange(q_len, device=anchors.device)[:, None]
    kv = torch.arange(ctx_len + q_len, device=anchors.device)[None, :]
    mod = block_mask_mod(anchors, ctx_len, block_size, sliding_window, context_start)
    return mod(None, None, q, kv)[None, None]


def block_tiles(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None,
                context_start: torch.Tensor | None = None, tile: int = TILE,
                block_keys: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full): bool ``[query tiles, key tiles]``; ``any`` marks tiles holding at least one visible pair,
    ``full`` tiles whose pairs are all visible (a subset of ``any``; tiles at the ragged edges are never full).
    ``block_keys=False``: the keys are the L context tokens only (the split form's context part).

    Block n's queries see context ``[lo_i, a)`` with ``lo_i = max(start, a + i - W + 1)`` (``start`` without a
    window) and block keys ``[nB + max(0, i - W + 1), nB + i + 1)`` (``[nB, nB + B)`` without a window). A key
    tile can hold a visible pair of block n iff it meets the union over i of those intervals, and is all
    visible to block n iff it lies inside one of them for every i (their intersection).
    """
    a = anchors.reshape(-1).long()
    dev = a.device
    N, L, B = a.numel(), int(ctx_len), int(block_size)
    start = torch.zeros_like(a) if context_start is None else context_start.reshape(-1).long().to(dev)
    q_len, kv_len = N * B, (L + N * B) if block_keys else L
    W = None if sliding_window is None else int(sliding_window)
    own = L + torch.arange(N, device=dev) * B  # first key index of each block's own keys
    if W is None:
        ctx_any_lo = ctx_all_lo = start
        blk_all = (own, own + B)
    else:
        ctx_any_lo = torch.maximum(start, a - W + 1)
        ctx_all_lo = torch.maximum(start, a + B - W)
        blk_all = (own + max(0, B - W), own + 1)  # empty unless B <= W
    n_kv = -(-kv_len // tile)
    c0 = torch.arange(n_kv, device=dev)[None, :] * tile  # [1, n_kv] nominal tile bounds [c0, c0 + tile)
    c1 = c0 + tile

    def meets(lo, hi):
        lo, hi = lo[:, None], hi[:, None]
        return (lo < hi) & (lo < c1) & (hi > c0)

    def covers(lo, hi):
        return (lo[:, None] <= c0) & (hi[:, None] >= c1)

    any_n = meets(ctx_any_lo, a)  # [N, n_kv]
    all_n = covers(ctx_all_lo, a)
    if block_keys:
        any_n = any_n | meets(own, own + B)
        all_n = all_n | covers(*blk_all)
    # blocks that overlap query tile t: first .. last (a block may straddle two tiles when B does not divide it)
    n_q = -(-q_len // tile)
    t = torch.arange(n_q, device=dev)
    first, last = (t * tile) // B, (torch.clamp((t + 1) * tile, max=q_len) - 1) // B
    span = -(-tile // B) + 1
    idx = torch.minimum(first[:, None] + torch.arange(span, device=dev)[None, :], last[:, None])  # [n_q, span]
    any_t = any_n[idx].any(1)
    all_t = all_n[idx].all(1) & ((t + 1) * tile <= q_len)[:, None]  # a ragged last query tile is never full
    return any_t, all_t & any_t


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None,
                    context_start: torch.Tensor | None = None, block_keys: bool = True):
    """A flex_attention ``BlockMask`` for the same predicate, with its tiles from ``block_tiles`` (built on the
    anchors' device, no host sync); ``block_keys=False``: over the L context keys only."""
    from torch.nn.attention.flex_attention import BlockMask

    anchors = anchors.reshape(-1).long()
    any_t, full_t = block_tiles(anchors, ctx_len, block_size, sliding_window, context_start, block_keys=block_keys)
    partial = (any_t & ~full_t).to(torch.int32)
    full = full_t.to(torch.int32)

    def as_blocks(dense):  # the layout create_block_mask produces: counts, then indices with the set ones first
        order = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    q_len = anchors.numel() * int(block_size)
    mod = block_mask_mod(anchors, ctx_len, block_size, sliding_window, context_start)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mod,
                                    seq_lengths=(q_len, int(ctx_len) + (q_len if block_keys else 0)))


def split_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None,
                     context_start: torch.Tensor | None = None, context: str = "auto",
                     kernel_options: dict | None = None) -> SplitBlockMask:
    """The split form's mask for one layer type (the signature of the builders above): the
    context part's mask, and the block layout for the in-block part (train/split_attention.py).

    context: how the context part is computed: "flex" (a BlockMask over the context keys), "dense" (a bool
    mask; differentiable on the CPU, where flex_attention has no backward) or "auto" (flex on CUDA, else dense).
    """
    if context not in ("auto", "flex", "dense"):
        raise ValueError(f"split context backend must be 'auto', 'flex' or 'dense', got {context!r}")
    if context == "auto":
        context = "flex" if anchors.device.type == "cuda" else "dense"
    ctx_mask = None
    if int(ctx_len) > 0 and context == "flex":
        ctx_mask = flex_block_mask(anchors, ctx_len, block_size, sliding_window, context_start, block_keys=False)
    elif int(ctx_len) > 0:
        full = dense_block_mask(anchors, ctx_len, block_size, sliding_window, context_start)
        ctx_mask = full[..., :int(ctx_len)].contiguous()
    return SplitBlockMask(ctx_mask, ctx_len, block_size, sliding_window, kernel_options)


def build_block_masks(anchors: torch.Tensor, ctx_len: int, block_size: int, layer_types: list[str],
                      sliding_window: int | None = None, backend: str = "dense",
                      context_start: torch.Tensor | None = None, causal: bool = False):
    """The ``attention_mask`` argument of the drafter for one packed pass; ``causal``: the full-attention layers
    are causal inside the block (a causal-in-block drafter).

    backend: "dense" (bool tensor, any device), "flex" (BlockMask; CUDA) or "split" (a mask that attends
    itself: context through flex_attention, each block densely; train/split_attention.py). Returns one mask
    when all layers are full attention, else a dict keyed by layer type.
    """
    if backend not in ("dense", "flex", "split"):
        raise ValueError(f"mask backend must be 'dense', 'flex' or 'split', got {backend!r}")
    build = {"dense": dense_block_mask, "flex": flex_block_mask, "split": split_block_mask}[backend]
    types = set(layer_types) or {"full_attention"}
    masks = {}
    if "full_attention" in types:
        masks["full_attention"] = build(anchors, ctx_len, block_size, CAUSAL_WINDOW if causal else None,
                                        context_start)
    if "sliding_attention" in types:
        if not sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        masks["sliding_attention"] = build(anchors, ctx_len, block_size, sliding_window, context_start)
    return masks["full_attention"] if types == {"full_attention"} else masks
