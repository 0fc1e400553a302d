"""Split block attention: the packed pass's attention as two exact parts merged by their log-sum-exp.

With keys ``[L context tokens; N*B block tokens]`` (train/block_mask.py), the queries of block n see two
disjoint key sets: part of their own sequence's context, and the B keys of their own block. One
flex_attention call over all keys spends tiles on the block diagonal (each 128 x 128 tile there holds
128 / B blocks of B x B visible pairs: 1/8 dense at B = 16) and reads K/V as one concatenation. The split
form computes
- the context part with flex_attention over the L context keys only (a BlockMask without the block keys,
  ``flex_block_mask(..., block_keys=False)``), which also returns each row's log-sum-exp;
- the in-block part as a dense batched matmul per block, ``[N, B, d] x [N, d, B] -> [N, B, B]`` scores, with
  the sliding rule ``k <= i and i - k < W`` inside the block on sliding-attention layers;
and merges them exactly (a softmax over the union of two disjoint key sets): with
``w = sigmoid(lse_ctx - lse_blk)``, ``out = out_blk + w * (out_ctx - out_blk)``.

Design choices:
- A row that sees no context (a block anchored at its sequence's start, a padding block) has
  ``lse_ctx = -inf``, so ``w = 0`` and it gets the in-block attention alone; every row sees at least its own
  key, so ``lse_blk`` is finite and the merge never produces NaN (nor does its gradient).
- flex_attention differentiates through the returned log-sum-exp, so autograd gives the exact gradients.
- The matmuls run in the inputs' dtype (fp32 accumulation); the in-block softmax and the merge in float32.
- The mask object carries its own ``attend(q, k, v, scale)``: the drafter calls it for a mask that is neither a
  tensor nor a BlockMask (drafter/modeling_dflash.py), so the model file needs no knowledge of this form.
- This module holds the attention arithmetic only and imports nothing of the mask rules: the mask object is
  built where the rules live (train/block_mask.py ``split_block_mask``), which imports this one.
- On CUDA the context part runs the compiled flex_attention (compiled with the layer when the layer is).
  Elsewhere it runs from a dense bool mask with plain tensor ops (flex_attention has no backward on the CPU);
  both give the same (out, lse), which the tests check.
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as fa

_FLEX = {}  # the compiled flex_attention (CUDA), built on first use
_AUX = getattr(fa, "AuxRequest", None)  # torch >= 2.9 asks for the log-sum-exp with return_aux=AuxRequest(lse=True)


def dense_context_attention(q, k, v, mask, scale: float):
    """The context part from a bool mask [1, 1, Q, L]: flex_attention's (out, lse) with plain tensor ops, which
    also differentiate on the CPU. An empty row gives out 0 and lse -inf, with zero (never NaN) gradients."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    empty = ~mask.any(-1)  # [1, 1, Q]
    s = s.masked_fill(~mask, float("-inf")).masked_fill(empty[..., None], 0.0)  # empty rows: finite, unused
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v).masked_fill(empty[..., None], 0.0)
    return out, lse.masked_fill(empty, float("-inf"))


def context_attention(q, k, v, context_mask, scale: float, kernel_options: dict | None = None):
    """Attention over the context keys: (out [b, Hq, Q, d], lse [b, Hq, Q] float32, -inf on empty rows).
    ``context_mask`` is a BlockMask (flex_attention) or a bool tensor (``dense_context_attention``)."""
    if torch.is_tensor(context_mask):
        return dense_context_attention(q, k, v, context_mask, scale)
    if torch.compiler.is_compiling():  # inside a compiled drafter layer: compiled with it
        flex = fa.flex_attention
    elif q.is_cuda:
        if "cuda" not in _FLEX:
            _FLEX["cuda"] = torch.compile(fa.flex_attention, dynamic=False)
        flex = _FLEX["cuda"]
    else:
        flex = fa.flex_attention
    kw = dict(block_mask=context_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if kernel_options:
        kw["kernel_options"] = kernel_options
    if _AUX is not None:
        out, aux = flex(q, k, v, return_aux=_AUX(lse=True), **kw)
        return out, aux.lse
    return flex(q, k, v, return_lse=True, **kw)


def in_block_attention(q, k, v, block_size: int, scale: float, sliding_window: int | None = None):
    """Each block's queries against its own B keys: (out [b, Hq, N*B, d] in q's dtype, lse [b, Hq, N*B] float32).

    q: [b, Hq, N*B, d]; k, v: [b, Hkv, N*B, d] (the block keys only); query head h uses key head h // (Hq/Hkv).
    """
    b, hq, q_len, d = q.shape
    hkv, B = k.shape[1], int(block_size)
    n = q_len // B
    qb = q.reshape(b, hkv, hq // hkv, n, B, d)
    kb = k.reshape(b, hkv, 1, n, B, d)
    vb = v.reshape(b, hkv, 1, n, B, d)
    s = torch.matmul(qb, kb.transpose(-1, -2)).float() * scale  # [b, Hkv, rep, N, B, B]
    if sliding_window is not None:
        i = torch.arange(B, device=q.device)[:, None]
        j = torch.arange(B, device=q.device)[None, :]
        s = s.masked_fill(~((j <= i) & (i - j < int(sliding_window))), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(v.dtype)
    out = torch.matmul(p, vb)
    return out.reshape(b, hq, q_len, d), lse.reshape(b, hq, q_len)


def merge_attention(out_a, lse_a, out_b, lse_b, dtype):
    """Softmax attention over the union of two disjoint key sets from each set's (out, lse); ``lse_b`` finite."""
    w = torch.sigmoid(lse_a.float() - lse_b)[..., None]
    ob = out_b.float()
    return (ob + w * (out_a.float() - ob)).to(dtype)


class SplitBlockMask:
    """The "split" backend's attention mask: the context BlockMask plus the block layout; ``attend`` computes
    the attention of q [b, Hq, N*B, d] against k, v [b, Hkv, L + N*B, d] (keys laid out as block_mask.py says)."""

    def __init__(self, context_mask, ctx_len: int, block_size: int, sliding_window: int | None = None,
                 kernel_options: dict | None = None):
        self.context_mask = context_mask
        self.ctx_len = int(ctx_len)
        self.block_size = int(block_size)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.kernel_options = kernel_options

    def attend(self, q, k, v, scale: float):
        L = self.ctx_len
        if k.shape[2] != L + q.shape[2]:
            raise ValueError(f"split block attention: {k.shape[2]} keys for {q.shape[2]} queries and a context of "
                             f"{L}; the keys must be [context; one per query]")
        out_b, lse_b = in_block_attention(q, k[:, :, L:], v[:, :, L:], self.block_size, scale, self.sliding_window)
        if L == 0:
            return out_b.to(q.dtype)
        out_c, lse_c = context_attention(q, k[:, :, :L], v[:, :, :L], self.context_mask, scale, self.kernel_options)
        return merge_attention(out_c, lse_c, out_b, lse_b, q.dtype)
