"""Triton kernel of tree attention (imported only where Triton is installed; see tree_attention.py).

Two launches: `_partial_kernel` (grid: row tiles x (prefix splits + 1 node split) x batch*kv heads) writes one
unnormalised (m, l, acc) per split; `_combine_kernel` merges the splits and writes [b, N, H, d].
Rows of a tile are (query head of the KV group, node) pairs, so one K/V tile serves the whole GQA group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton kernels take their arguments flat (tensors, strides, constexpr sizes), and so do the launchers below that
# pass them on: these functions keep their long parameter lists rather than bundling them into objects.


@triton.jit
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
            PRECISION: tl.constexpr):
    """One K/V tile of online softmax. k: [BLOCK_N, BLOCK_D]; visible: [BLOCK_M, BLOCK_N] (used when MASKED)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_SOFTCAP:
        x = s * (qk_scale / 1.4426950408889634) / softcap  # natural-log units, then tanh written with exp
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _partial_kernel(Q, K, V, NodeMask, NodePos, PrefixLens, Opart, Mpart, Lpart,
                    sq_b, sq_h, sq_n, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_i, sp_b,
                    qk_scale, softcap, window, num_kv_heads, group, num_nodes, num_parts, num_splits, split_len,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    num_rows = group * num_nodes
    row_ok = rows < num_rows
    head = kvh * group + rows // num_nodes
    node = rows % num_nodes
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + node[:, None] * sq_n + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    prefix = tl.load(PrefixLens + b)
    qpos = tl.load(NodePos + b * sp_b + node, mask=row_ok, other=0)
    k_base = K + b * sk_b + kvh * sk_h
    v_base = V + b * sv_b + kvh * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_N)
    if pid_s < num_splits:  # a chunk of the prefix: every node sees every key (rows past the end are dropped)
        start = pid_s * split_len
        end = tl.minimum(start + split_len, prefix)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for k0 in range(start, full_end, BLOCK_N):  # whole tiles: no key mask
            offs_n = k0 + offs_t
            k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            if HAS_WINDOW:
                visible = (qpos[:, None] - offs_n[None, :]) < window
                m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, True,
                                        PRECISION)
            else:
                m_i, l_i, acc = _attend(q, k, v, None, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, False,
                                        PRECISION)
        if full_end < end:  # the last, partial tile
            offs_n = full_end + offs_t
            n_ok = offs_n < end
            k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            visible = n_ok[None, :]
            if HAS_WINDOW:
                visible = visible & ((qpos[:, None] - offs_n[None, :]) < window)
            m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, True,
                                    PRECISION)
    else:  # the nodes of this round, under the ancestor mask
        for j0 in range(0, num_nodes, BLOCK_N):
            offs_j = j0 + offs_t
            j_ok = offs_j < num_nodes
            slots = prefix + offs_j
            k = tl.load(k_base + slots[:, None] * sk_s + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                        other=0.0)
            v = tl.load(v_base + slots[:, None] * sv_s + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                        other=0.0)
            tree = tl.load(NodeMask + b * sm_b + node[:, None] * sm_i + offs_j[None, :],
                           mask=row_ok[:, None] & j_ok[None, :], other=0)
            visible = tree != 0
            if HAS_WINDOW:
                kpos = tl.load(NodePos + b * sp_b + offs_j, mask=j_ok, other=0)
                visible = visible & ((qpos[:, None] - kpos[None, :]) < window)
            m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, True,
                                    PRECISION)
    part = (pid_bh * num_parts + pid_s) * num_rows
    tl.store(Mpart + part + rows, m_i, mask=row_ok)
    tl.store(Lpart + part + rows, l_i, mask=row_ok)
    tl.store(Opart + (part + rows[:, None]) * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(Opart, Mpart, Lpart, Out, so_b, so_n, so_h,
                    num_kv_heads, group, num_nodes, num_parts,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    num_rows = group * num_nodes
    row_ok = rows < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_parts):
        part = (pid_bh * num_parts + s) * num_rows
        m_max = tl.maximum(m_max, tl.load(Mpart + part + rows, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, num_parts):
        part = (pid_bh * num_parts + s) * num_rows
        w = tl.exp2(tl.load(Mpart + part + rows, mask=row_ok, other=float("-inf")) - m_safe)
        l_tot += w * tl.load(Lpart + part + rows, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(Opart + (part + rows[:, None]) * BLOCK_D + offs_d[None, :],
                                    mask=row_ok[:, None], other=0.0)
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    head = kvh * group + rows // num_nodes
    node = rows % num_nodes
    tl.store(Out + b * so_b + node[:, None] * so_n + head[:, None] * so_h + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


MIN_SPLIT = 256  # keys per prefix split at least: more splits cost more partials to write and merge
# (head_dim, dtype, wide) -> (block_m, block_n, num_warps, num_stages) that compiled within shared memory
_WORKING_CONFIGS: dict[tuple, tuple[int, int, int, int]] = {}


def _default_config(block_d: int, element_size: int, rows: int) -> tuple[int, int, int, int]:
    wide = block_d * element_size > 256  # d 256 in bf16, d 128 in fp32: smaller tiles, no pipelining
    if wide:
        return 64, 32, 4, 1
    return (64, 64, 4, 3) if rows <= 64 else (128, 32, 4, 3)


def _smaller(config: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    block_m, block_n, warps, stages = config
    if stages > 1:
        return block_m, block_n, warps, 1
    if block_n > 16:
        return block_m, block_n // 2, warps, stages
    if block_m > 16:
        return block_m // 2, block_n, 4, stages
    return None


def tree_attention_triton(query, key, value, prefix_lens, node_mask, node_positions, scale: float,
                          sliding_window: int | None = None, softcap: float | None = None,
                          max_prefix_len: int | None = None, block_m: int | None = None, block_n: int | None = None,
                          num_splits: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None) -> torch.Tensor:
    """The Triton kernel. max_prefix_len (host int) avoids a device sync; block sizes, warps, stages and splits
    are tunables (defaults by head size; a configuration that does not fit shared memory is shrunk)."""
    b, h, n, d = query.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("tree attention needs the head dimension contiguous in query, key and value")
    if max_prefix_len is None:
        max_prefix_len = int(prefix_lens.max())
    block_d = max(16, triton.next_power_of_2(d))
    rows = h // key.shape[1] * n
    cache_key = (d, query.dtype, rows > 64)
    default = _WORKING_CONFIGS.get(cache_key) or _default_config(block_d, query.element_size(), rows)
    config = (block_m or default[0], block_n or default[1], num_warps or default[2], num_stages or default[3])
    while True:
        try:
            out = _launch(query, key, value, prefix_lens, node_mask, node_positions, scale, sliding_window, softcap,
                          max_prefix_len, num_splits, block_d, *config)
        except triton.runtime.errors.OutOfResources:
            config = _smaller(config)
            if config is None:
                raise
            continue
        if not any((block_m, block_n, num_warps, num_stages)):
            _WORKING_CONFIGS[cache_key] = config
        return out


def _launch(query, key, value, prefix_lens, node_mask, node_positions, scale, sliding_window, softcap,
            max_prefix_len, num_splits, block_d, block_m, block_n, num_warps, num_stages):
    b, h, n, d = query.shape
    hkv = key.shape[1]
    group = h // hkv
    num_rows = group * n
    row_tiles = triton.cdiv(num_rows, block_m)
    if num_splits is None:  # about four programs per multiprocessor, no chunk shorter than MIN_SPLIT keys
        wanted = triton.cdiv(4 * _num_sms(query.device), b * hkv * row_tiles)
        num_splits = max(1, min(wanted, triton.cdiv(max_prefix_len, MIN_SPLIT))) if max_prefix_len > 0 else 0
    split_len = triton.cdiv(triton.cdiv(max(max_prefix_len, 1), max(num_splits, 1)), block_n) * block_n
    num_splits = triton.cdiv(max_prefix_len, split_len) if max_prefix_len > 0 else 0
    num_parts = num_splits + 1

    node_mask = node_mask.to(torch.uint8).expand(b, n, n)  # no copy when the caller passes uint8 already
    if node_mask.stride(-1) != 1:
        node_mask = node_mask.contiguous()
    prefix_lens = prefix_lens.to(device=query.device, dtype=torch.int32).contiguous()
    node_positions = node_positions.to(device=query.device, dtype=torch.int32).contiguous()
    m_part = torch.empty(b * hkv * num_parts * num_rows, device=query.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty(b * hkv * num_parts * num_rows * block_d, device=query.device, dtype=torch.float32)
    out = torch.empty(b, n, h, d, device=query.device, dtype=query.dtype)
    qk_scale = scale * 1.4426950408889634  # exp2 units
    _partial_kernel[(row_tiles, num_parts, b * hkv)](
        query, key, value, node_mask, node_positions, prefix_lens, o_part, m_part, l_part,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), node_mask.stride(0), node_mask.stride(1),
        node_positions.stride(0), qk_scale, float(softcap or 1.0), int(sliding_window or 0), hkv, group, n,
        num_parts, num_splits, split_len, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=softcap is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    _combine_kernel[(row_tiles, b * hkv)](
        o_part, m_part, l_part, out, out.stride(0), out.stride(1), out.stride(2), hkv, group, n, num_parts,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4)
    return out
