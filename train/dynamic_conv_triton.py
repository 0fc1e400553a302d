"""Triton kernels of DFlash2's in-block convolution in training (imported only where Triton runs;
train/dynamic_conv.py).

The convolution (drafter/modeling_dflash2.grouped_dynamic_causal_conv) is, for rows m of [M, H] laid out as whole
blocks of BS positions (t = m mod BS) and taps o < K,

    out[m, h] = sum_{o <= t} (base[o, h] + dyn[m, o, h // GS]) * x[m - o, h]

and its gradients are

    grad_x[m, h]      = sum_{t + o < BS} (base[o, h] + dyn[m + o, o, h // GS]) * g[m + o, h]
    grad_dyn[m, o, j] = sum_{h in group j} g[m, h] * x[m - o, h]        (0 where t < o)
    grad_base[o, h]   = sum_m g[m, h] * x[m - o, h].

Compiled by inductor, the torch expression took ~29 ms of a DFlash2 training step at the testbed's shape, in
several passes over [~86k block positions, 576] each way (BENCHMARKS.md, lease 8). Here one program takes a
[BLOCK_M, BLOCK_H] tile (whole blocks where the block is a power of two, so the shifted rows it reads are its
own) and does the forward in one pass, the backward's three gradients in another: x, g and the taps read once a
tile, products summed in float32. ``grad_base`` is reduced per row tile into a float32 buffer [tiles, K, H] and
summed by the caller (no atomics: the same bits every run). Base and dyn are rounded to x's dtype before use, as
the torch expression casts them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_forward(X, Dyn, Base, Out, n_rows, hidden, block, stride_x, stride_dm, stride_do, stride_b, stride_out,
                  K: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = m % block
    m_ok, h_ok = m < n_rows, h < hidden
    group = h // GS
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for o in tl.static_range(K):
        ok = (m_ok & (t >= o))[:, None] & h_ok[None, :]
        x = tl.load(X + (m - o)[:, None] * stride_x + h[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.load(Dyn + m[:, None] * stride_dm + o * stride_do + group[None, :], mask=ok, other=0.0)
        b = tl.load(Base + o * stride_b + h, mask=h_ok, other=0.0)
        w = b.to(X.dtype.element_ty).to(tl.float32)[None, :] + d.to(X.dtype.element_ty).to(tl.float32)
        acc += w * x
    ok = m_ok[:, None] & h_ok[None, :]
    tl.store(Out + m[:, None] * stride_out + h[None, :], acc.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _conv_backward(G, X, Dyn, Base, GradX, GradDyn, GradBase, n_rows, hidden, block, stride_g, stride_x, stride_dm,
                   stride_do, stride_b, stride_gx, stride_gdm, stride_gdo, stride_gbt, stride_gbo,
                   K: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_m = tl.program_id(0)
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = m % block
    m_ok, h_ok = m < n_rows, h < hidden
    group = h // GS
    ok = m_ok[:, None] & h_ok[None, :]
    g = tl.load(G + m[:, None] * stride_g + h[None, :], mask=ok, other=0.0).to(tl.float32)
    grad_x = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    j = tl.program_id(1) * (BLOCK_H // GS) + tl.arange(0, BLOCK_H // GS)
    j_ok = j < hidden // GS
    for o in tl.static_range(K):
        b = tl.load(Base + o * stride_b + h, mask=h_ok, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        # grad_x: the output row m + o of the same block read this row through tap o
        ahead = (m_ok & (t + o < block) & (m + o < n_rows))[:, None] & h_ok[None, :]
        g_ahead = tl.load(G + (m + o)[:, None] * stride_g + h[None, :], mask=ahead, other=0.0).to(tl.float32)
        d_ahead = tl.load(Dyn + (m + o)[:, None] * stride_dm + o * stride_do + group[None, :], mask=ahead,
                          other=0.0).to(X.dtype.element_ty).to(tl.float32)
        grad_x += (b[None, :] + d_ahead) * g_ahead
        # grad_dyn and grad_base: this row's gradient times the row o places back
        back = (m_ok & (t >= o))[:, None] & h_ok[None, :]
        x_back = tl.load(X + (m - o)[:, None] * stride_x + h[None, :], mask=back, other=0.0).to(tl.float32)
        product = g * x_back
        per_group = tl.sum(tl.reshape(product, [BLOCK_M, BLOCK_H // GS, GS]), axis=2)
        tl.store(GradDyn + m[:, None] * stride_gdm + o * stride_gdo + j[None, :],
                 per_group.to(GradDyn.dtype.element_ty), mask=m_ok[:, None] & j_ok[None, :])
        tl.store(GradBase + pid_m * stride_gbt + o * stride_gbo + h, tl.sum(product, axis=0), mask=h_ok)
    tl.store(GradX + m[:, None] * stride_gx + h[None, :], grad_x.to(GradX.dtype.element_ty), mask=ok)


# the tile's rows and channels and the warps per program; bench/bench_dynamic_conv.py --sweep times others
TILE = {"rows": 64, "channels": 64, "num_warps": 4}


def tiles(block: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_H): TILE's rows (at least the block's next power of two: whole blocks where the block is
    a power of two; any block is right, a tile's shifted rows are then read from its neighbours) and channels
    (at least one group)."""
    return max(TILE["rows"], triton.next_power_of_2(block)), max(TILE["channels"], group)


def launch_forward(x, dyn, base, out, group_size: int, block_size: int) -> None:
    """x [M, H], dyn [M, K, H / group_size], base [K, H] (each contiguous in its last dim) -> out [M, H]."""
    n_rows, hidden = x.shape
    block_m, block_h = tiles(block_size, group_size)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(hidden, block_h))
    _conv_forward[grid](x, dyn, base, out, n_rows, hidden, block_size, x.stride(0), dyn.stride(0), dyn.stride(1),
                        base.stride(0), out.stride(0), K=dyn.shape[1], GS=group_size, BLOCK_M=block_m,
                        BLOCK_H=block_h, num_warps=TILE["num_warps"])


def launch_backward(grad, x, dyn, base, grad_x, grad_dyn, grad_base_tiles, group_size: int,
                    block_size: int) -> None:
    """grad [M, H] -> grad_x [M, H], grad_dyn [M, K, G] and grad_base_tiles [row tiles, K, H] (float32), all
    written whole; ``row_tiles`` gives the first dimension of the last."""
    n_rows, hidden = x.shape
    block_m, block_h = tiles(block_size, group_size)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(hidden, block_h))
    _conv_backward[grid](grad, x, dyn, base, grad_x, grad_dyn, grad_base_tiles, n_rows, hidden, block_size,
                         grad.stride(0), x.stride(0), dyn.stride(0), dyn.stride(1), base.stride(0), grad_x.stride(0),
                         grad_dyn.stride(0), grad_dyn.stride(1), grad_base_tiles.stride(0),
                         grad_base_tiles.stride(1), K=dyn.shape[1], GS=group_size, BLOCK_M=block_m,
                         BLOCK_H=block_h, num_warps=TILE["num_warps"])


def row_tiles(n_rows: int, block_size: int, group_size: int) -> int:
    """The number of row tiles the kernels use for n_rows rows: the first dimension of grad_base_tiles."""
    return triton.cdiv(n_rows, tiles(block_size, group_size)[0])
