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
several passes over [~86k block positions, 576] each way (profiled on an H200). Here one program takes a tile
of [BLOCK_M rows, BLOCK_G groups, GS channels] (whole blocks where the block is a power of two, so the shifted
rows it reads are its own) and does the forward in one pass, the backward's three gradients in another: x, g and
the taps read once a tile, products summed in float32. The tile is three-dimensional so that a dynamic tap, one
per row and group, is loaded once as [BLOCK_M, BLOCK_G] and broadcast over its group's channels, and its gradient
is a sum over the last axis; the first form of these kernels (a [rows, channels] tile) gathered the tap per
channel and reshaped to sum, and ran at a fourth (forward) to a seventh (backward) of what an H100's bandwidth
allows, slower than inductor's passes. ``grad_base`` is reduced per row tile into a float32
buffer [tiles, K, H] and summed by the caller (no atomics: the same bits every run). Base and dyn are rounded to
x's dtype before use, as the torch expression casts them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_forward(X, Dyn, Base, Out, n_rows, groups, stride_x, stride_dm, stride_do, stride_b, stride_out,
                  K: tl.constexpr, GS: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    c = tl.arange(0, GS)
    t = m % BS
    m_ok, j_ok = m < n_rows, j < groups
    h = j[:, None] * GS + c[None, :]  # [BLOCK_G, GS]: the channels of the tile's groups
    acc = tl.zeros([BLOCK_M, BLOCK_G, GS], dtype=tl.float32)
    for o in tl.static_range(K):
        ok = (m_ok & (t >= o))[:, None] & j_ok[None, :]  # [BLOCK_M, BLOCK_G]
        x = tl.load(X + (m - o)[:, None, None] * stride_x + h[None, :, :], mask=ok[:, :, None], other=0.0)
        d = tl.load(Dyn + m[:, None] * stride_dm + o * stride_do + j[None, :], mask=ok, other=0.0)
        b = tl.load(Base + o * stride_b + h, mask=j_ok[:, None], other=0.0)
        w = b.to(X.dtype.element_ty).to(tl.float32)[None, :, :] + d.to(X.dtype.element_ty).to(tl.float32)[:, :, None]
        acc += w * x.to(tl.float32)
    ok = m_ok[:, None, None] & j_ok[None, :, None]
    tl.store(Out + m[:, None, None] * stride_out + h[None, :, :], acc.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _conv_backward(G, X, Dyn, Base, GradX, GradDyn, GradBase, n_rows, groups, stride_g, stride_x, stride_dm,
                   stride_do, stride_b, stride_gx, stride_gdm, stride_gdo, stride_gbt, stride_gbo,
                   K: tl.constexpr, GS: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_G: tl.constexpr):
    pid_m = tl.program_id(0)
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    c = tl.arange(0, GS)
    t = m % BS
    m_ok, j_ok = m < n_rows, j < groups
    h = j[:, None] * GS + c[None, :]
    ok = m_ok[:, None] & j_ok[None, :]
    g = tl.load(G + m[:, None, None] * stride_g + h[None, :, :], mask=ok[:, :, None], other=0.0).to(tl.float32)
    grad_x = tl.zeros([BLOCK_M, BLOCK_G, GS], dtype=tl.float32)
    for o in tl.static_range(K):
        b = tl.load(Base + o * stride_b + h, mask=j_ok[:, None], other=0.0).to(X.dtype.element_ty).to(tl.float32)
        # grad_x: the output row m + o of the same block read this row through tap o
        ahead = (m_ok & (t + o < BS) & (m + o < n_rows))[:, None] & j_ok[None, :]
        if o == 0:  # tap 0 reads the row itself: g is already loaded
            g_ahead = g
        else:
            g_ahead = tl.load(G + (m + o)[:, None, None] * stride_g + h[None, :, :], mask=ahead[:, :, None],
                              other=0.0).to(tl.float32)
        d_ahead = tl.load(Dyn + (m + o)[:, None] * stride_dm + o * stride_do + j[None, :], mask=ahead,
                          other=0.0).to(X.dtype.element_ty).to(tl.float32)
        grad_x += (b[None, :, :] + d_ahead[:, :, None]) * g_ahead
        # grad_dyn and grad_base: this row's gradient times the row o places back
        back = (m_ok & (t >= o))[:, None] & j_ok[None, :]
        x_back = tl.load(X + (m - o)[:, None, None] * stride_x + h[None, :, :], mask=back[:, :, None],
                         other=0.0).to(tl.float32)
        product = g * x_back
        tl.store(GradDyn + m[:, None] * stride_gdm + o * stride_gdo + j[None, :],
                 tl.sum(product, axis=2).to(GradDyn.dtype.element_ty), mask=ok)
        tl.store(GradBase + pid_m * stride_gbt + o * stride_gbo + h, tl.sum(product, axis=0), mask=j_ok[:, None])
    tl.store(GradX + m[:, None, None] * stride_gx + h[None, :, :], grad_x.to(GradX.dtype.element_ty),
             mask=ok[:, :, None])


# the tile (rows x channels a program, warps): the best of a sweep of tile sizes on one H100
TILE = {"rows": 128, "channels": 64, "num_warps": 4}


def tiles(block: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_H): TILE's rows (at least the block's next power of two: whole blocks where the block is
    a power of two; any block is right, a tile's shifted rows are then read from its neighbours) and channels
    (at least one group)."""
    return max(TILE["rows"], triton.next_power_of_2(block)), max(TILE["channels"], group)


def _geometry(x, dyn, group_size: int, block_size: int) -> tuple[tuple[int, int], dict]:
    """Both kernels' grid (row tiles, group tiles) and compile-time arguments for rows x and taps dyn."""
    block_m, block_h = tiles(block_size, group_size)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(dyn.shape[2], block_h // group_size))
    return grid, {"K": dyn.shape[1], "GS": group_size, "BS": block_size, "BLOCK_M": block_m,
                  "BLOCK_G": block_h // group_size, "num_warps": TILE["num_warps"]}


def launch_forward(x, dyn, base, out, group_size: int, block_size: int) -> None:
    """x [M, H], dyn [M, K, H / group_size], base [K, H] (each contiguous in its last dim) -> out [M, H]."""
    grid, meta = _geometry(x, dyn, group_size, block_size)
    _conv_forward[grid](x, dyn, base, out, x.shape[0], dyn.shape[2], x.stride(0), dyn.stride(0), dyn.stride(1),
                        base.stride(0), out.stride(0), **meta)


def launch_backward(grad, x, dyn, base, grad_x, grad_dyn, grad_base_tiles, group_size: int,
                    block_size: int) -> None:
    """grad [M, H] -> grad_x [M, H], grad_dyn [M, K, G] and grad_base_tiles [row tiles, K, H] (float32), all
    written whole; ``row_tiles`` gives the first dimension of the last."""
    grid, meta = _geometry(x, dyn, group_size, block_size)
    _conv_backward[grid](grad, x, dyn, base, grad_x, grad_dyn, grad_base_tiles, x.shape[0], dyn.shape[2],
                         grad.stride(0), x.stride(0), dyn.stride(0), dyn.stride(1), base.stride(0), grad_x.stride(0),
                         grad_dyn.stride(0), grad_dyn.stride(1), grad_base_tiles.stride(0),
                         grad_base_tiles.stride(1), **meta)


def row_tiles(n_rows: int, block_size: int, group_size: int) -> int:
    """The number of row tiles the kernels use for n_rows rows: the first dimension of grad_base_tiles."""
    return triton.cdiv(n_rows, tiles(block_size, group_size)[0])
