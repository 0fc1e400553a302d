"""The attention mask of one packed training pass: N blocks of B tokens against L context tokens.

Keys are laid out as ``[L context tokens, then N*B block tokens]``; queries are the N*B block tokens. Query
``q = n*B + i`` is position i of block n, whose anchor is ``anchors[n]`` (absolute position ``anchors[n] + i``).

Rules (the same ones decoding applies one block at a time):
- full-attention layers: block n sees context positions ``j < anchors[n]`` (strictly before its anchor) and
  every token of its own block (bidirectional); never another block.
- sliding-attention layers (window W): as full, plus the reference's decode-time rule, which is causal over the
  absolute position with a window: query at ``a + i`` may see key at absolute position ``j`` iff
  ``j <= a + i`` and ``a + i - j < W``. Inside the block that is ``k <= i`` and ``i - k < W``.

Design choices:
- One predicate (``block_mask_mod``) is the single source of truth. The CPU path evaluates it on a broadcast
  index grid into a dense bool mask for SDPA; the CUDA path hands the same predicate to
  ``torch.nn.attention.flex_attention.create_block_mask``. Tests compare both to an element-by-element loop.
- Anchors may overlap (blocks of nearby anchors cover the same positions) and a block may run past the end of
  the sequence (a partial tail): the mask only depends on the anchor, so neither needs a special case.
- A model with both layer types gets a dict ``{"full_attention": mask, "sliding_attention": mask}``.
"""

from __future__ import annotations

from typing import Callable

import torch


def block_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int,
                   sliding_window: int | None = None) -> Callable:
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
        blk_ok = m == n
        if W is not None:
            ctx_ok = ctx_ok & (a + i - kv_idx < W)
            blk_ok = blk_ok & (k <= i) & (i - k < W)
        return torch.where(is_ctx, ctx_ok, blk_ok)

    return mask_mod


def dense_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Bool mask ``[1, 1, N*B, L + N*B]`` (True = may attend) for SDPA."""
    anchors = anchors.reshape(-1).long()
    q_len = anchors.numel() * block_size
    q = torch.arange(q_len, device=anchors.device)[:, None]
    kv = torch.arange(ctx_len + q_len, device=anchors.device)[None, :]
    mod = block_mask_mod(anchors, ctx_len, block_size, sliding_window)
    return mod(None, None, q, kv)[None, None]


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None):
    """A flex_attention ``BlockMask`` from the same predicate (built on the anchors' device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors = anchors.reshape(-1).long()
    q_len = anchors.numel() * block_size
    mod = block_mask_mod(anchors, ctx_len, block_size, sliding_window)
    return create_block_mask(mod, B=None, H=None, Q_LEN=q_len, KV_LEN=ctx_len + q_len,
                             device=str(anchors.device))


def build_block_masks(anchors: torch.Tensor, ctx_len: int, block_size: int, layer_types: list[str],
                      sliding_window: int | None = None, backend: str = "dense"):
    """The ``attention_mask`` argument of the drafter for one packed pass.

    backend: "dense" (bool tensor, any device) or "flex" (BlockMask; CUDA). Returns one mask when all layers
    are full attention, else a dict keyed by layer type.
    """
    if backend not in ("dense", "flex"):
        raise ValueError(f"mask backend must be 'dense' or 'flex', got {backend!r}")
    build = dense_block_mask if backend == "dense" else flex_block_mask
    types = set(layer_types) or {"full_attention"}
    masks = {}
    if "full_attention" in types:
        masks["full_attention"] = build(anchors, ctx_len, block_size, None)
    if "sliding_attention" in types:
        if not sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        masks["sliding_attention"] = build(anchors, ctx_len, block_size, sliding_window)
    return masks["full_attention"] if types == {"full_attention"} else masks
