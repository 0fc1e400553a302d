"""Triton kernel of grouped_topk (imported only where Triton is installed; see train/grouped_topk.py).

One program per row, one launch per chunk of logits, for a vocabulary of whole groups. The program keeps, per
group, the key of its best logit not yet taken (at the start: the group's maximum, at the group's first column),
and takes the k largest in k rounds: the group with the largest key, then, from that group's logits (read from
the logits themselves), the logit it stands for, and the group's next one below it as its new key. So the row is
never read whole: only the groups that hold the row's k largest, at most k of them (those with the largest
maxima, train/grouped_topk.py's module notes), each read again (from the cache) for every further logit taken from it.
The values are read back from the logits at the columns taken (the logits' own, in their dtype).

Design choices:
- A logit and its column are one int64 key: the float32 value's bits, made order-preserving as a signed integer,
  in the high half, 2**31 - 1 - column in the low half. The largest key is the largest value and, among equal
  values, the lowest column, so a round is one max and equal logits (-inf ones too) are each taken once, lowest
  column first. A group's first key (its maximum at its first column) is at least every key of the group and,
  as groups hold disjoint columns, orders it against the other groups as its best logit would. So the result is
  the row's top k under (value descending, column ascending), given the exact group maxima; the ids differ from
  torch.topk's only among equal logits.
- Comparisons run on float32, exact for bf16, fp16 and fp32 logits; -0.0 counts as +0.0 (torch compares them
  equal). A NaN (positive, as the GPU writes it) counts above +inf, as torch.topk orders it.
- One warp per row by default: each round is three reductions over a group or the group keys, inside the warp
  (1 warp: ~290 instructions a round, against ~1,270 for 8 warps over a [k, group] tile of the k best groups,
  k 16, groups of 256, sm_90 SASS). Timed on an H200: 1 and 4 warps tie (0.057 ms a
  chunk of 2,048 rows × 49,152), 2 are slower (0.078 ms); torch's grouped path takes 0.336 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_GROUPS = 1024  # group keys held at once (593 for Qwen3's vocabulary at groups of 256)
MAX_GROUP = 1024  # logits of one group read at once


@triton.jit
def _keys(v, col):
    """int64 keys of float32 values ``v`` at columns ``col``: larger value first, then lower column."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 as +0.0
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller integer
    return (bits.to(tl.int64) << 32) + (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def _column(key):
    """The column a key was made with (its low half)."""
    return 0x7FFFFFFF - (key - ((key >> 32) << 32))


@triton.jit
def _grouped_topk_kernel(X, GroupMax, Values, Ids, stride_x, stride_gm, stride_v0, stride_v1, stride_i0, stride_i1,
                         n_groups, K: tl.constexpr, K_BLOCK: tl.constexpr, GROUP: tl.constexpr,
                         G_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    none = tl.full([], -(2**63), tl.int64)  # below every real key: a padded or emptied group
    g = tl.arange(0, G_BLOCK)
    gmax = tl.load(GroupMax + row * stride_gm + g, mask=g < n_groups, other=0.0).to(tl.float32)
    best = tl.where(g < n_groups, _keys(gmax, g * GROUP), none)  # per group, its best key not yet taken
    c = tl.arange(0, GROUP)
    slots = tl.arange(0, K_BLOCK)
    ids = tl.zeros([K_BLOCK], tl.int64)
    for j in range(K):
        top = tl.max(best, 0)
        start = _column(top) // GROUP * GROUP  # the group's first column
        keys = _keys(tl.load(x_row + start + c).to(tl.float32), start + c)
        taken = tl.max(tl.where(keys <= top, keys, none), 0)  # the logit ``top`` stands for
        ids = tl.where(slots == j, _column(taken), ids)
        best = tl.where(g * GROUP == start, tl.max(tl.where(keys < taken, keys, none), 0), best)
    out = slots < K
    tl.store(Ids + row * stride_i0 + slots * stride_i1, ids, mask=out)
    tl.store(Values + row * stride_v0 + slots * stride_v1, tl.load(x_row + ids, mask=out), mask=out)


def kernel_fits(x: torch.Tensor, k: int, group: int) -> bool:
    """Whether the kernel takes this case: fp32/bf16/fp16 logits with unit column stride, a vocabulary of whole
    groups, a power-of-two group of at most MAX_GROUP logits, at most MAX_GROUPS groups."""
    rows, cols = x.shape
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(1) == 1 and rows > 0 and k > 0
            and cols % group == 0 and group & (group - 1) == 0 and group <= MAX_GROUP
            and cols // group <= MAX_GROUPS)


def grouped_topk_triton(x: torch.Tensor, k: int, group: int, group_max: torch.Tensor | None = None,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None,
                        num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_topk's kernel (the case must fit: ``kernel_fits``): (values in x's dtype, long ids) [rows, k],
    largest first, written into ``out`` when given (any row and column strides). ``group_max``: the group
    maxima [rows, cols // group], used when they hold x's values exactly (x's dtype, float32 or float64; else,
    or when None, computed here); ``num_warps``: a tunable (module notes)."""
    rows, cols = x.shape
    n_groups = cols // group
    if group_max is None or group_max.dtype not in (x.dtype, torch.float32, torch.float64):
        group_max = x.unflatten(1, (n_groups, group)).amax(-1)
    if group_max.stride(1) != 1:
        group_max = group_max.contiguous()
    if out is None:
        out = (torch.empty(rows, k, dtype=x.dtype, device=x.device),
               torch.empty(rows, k, dtype=torch.long, device=x.device))
    values, ids = out
    if group_max.shape != (rows, n_groups) or values.shape != (rows, k) or ids.shape != (rows, k):
        raise ValueError(f"grouped_topk_triton: group_max {tuple(group_max.shape)} must be {(rows, n_groups)}, "
                         f"out {tuple(values.shape)}, {tuple(ids.shape)} must be {(rows, k)}")
    _grouped_topk_kernel[(rows,)](
        x, group_max, values, ids, x.stride(0), group_max.stride(0), values.stride(0), values.stride(1),
        ids.stride(0), ids.stride(1), n_groups, K=k, K_BLOCK=max(16, triton.next_power_of_2(k)), GROUP=group,
        G_BLOCK=max(16, triton.next_power_of_2(n_groups)), num_warps=num_warps)
    return values, ids
