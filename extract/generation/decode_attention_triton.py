"""Triton kernel of slot decode attention (imported only where Triton is installed; see decode_attention.py).

`_split_kernel` (grid: column splits x slots*kv heads) runs online softmax over its slot's columns in its split,
from the window's start (if any) to the slot's own position. With one split it normalises and writes the output
itself; with several it writes one unnormalised (m, l, acc) per split and `_combine_kernel` merges them.
The rows of a tile are the query heads of one K/V head's group (padded to 16 for tl.dot), so each K/V tile is
loaded once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(Q, K, V, Pos, Out, Opart, Mpart, Lpart,
                  sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h,
                  qk_scale, window, num_kv_heads, group, split_len,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    num_splits = tl.num_programs(0)
    b = (pid_bh // num_kv_heads).to(tl.int64)  # slot offsets can pass 2**31 elements in a large cache
    kvh = pid_bh % num_kv_heads
    rows = tl.arange(0, BLOCK_G)
    row_ok = rows < group
    head = kvh * group + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    end = tl.load(Pos + b).to(tl.int32) + 1  # columns 0..position
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, end)
    if HAS_WINDOW:
        lo = tl.maximum(lo, end - window)
    k_base = K + b * sk_b + kvh * sk_h
    v_base = V + b * sv_b + kvh * sv_h
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_N)
    for k0 in range(lo, hi, BLOCK_N):
        offs_n = k0 + offs_t
        n_ok = offs_n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # exp2 units
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile has a visible column: m_new is finite
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SINGLE:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + b * so_b + head[:, None] * so_h + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (pid_bh * num_splits + pid_s) * BLOCK_G + rows
        tl.store(Mpart + part, m_i)
        tl.store(Lpart + part, l_i)
        tl.store(Opart + part[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def _combine_kernel(Opart, Mpart, Lpart, Out, so_b, so_h, num_kv_heads, group, num_splits,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    rows = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m_max = tl.maximum(m_max, tl.load(Mpart + (pid_bh * num_splits + s) * BLOCK_G + rows))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        part = (pid_bh * num_splits + s) * BLOCK_G + rows
        w = tl.exp2(tl.load(Mpart + part) - m_safe)  # an empty split: m = -inf, weight 0
        l_tot += w * tl.load(Lpart + part)
        acc += w[:, None] * tl.load(Opart + part[:, None] * BLOCK_D + offs_d[None, :])
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    head = kvh * group + rows
    tl.store(Out + b * so_b + head[:, None] * so_h + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=(rows < group)[:, None] & (offs_d[None, :] < HEAD_DIM))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


MIN_SPLIT = 256  # columns per split at least: shorter splits cost more partials than they balance
# (head_dim, dtype) -> (block_n, num_warps, num_stages) that compiled within shared memory
_WORKING_CONFIGS: dict[tuple, tuple[int, int, int]] = {}


def _default_config(block_d: int, element_size: int) -> tuple[int, int, int]:
    if block_d * element_size > 256:  # d 256 in bf16, d 128 in fp32: smaller tiles
        return 32, 4, 2
    return 64, 4, 3


def _smaller(config: tuple[int, int, int]) -> tuple[int, int, int] | None:
    block_n, warps, stages = config
    if stages > 1:
        return block_n, warps, 1
    if block_n > 16:
        return block_n // 2, warps, stages
    return None


def choose_splits(slots: int, kv_heads: int, length: int, num_sms: int) -> int:
    """Splits of the columns: enough programs for about four per multiprocessor, no split under MIN_SPLIT
    columns (1,024 slots x 3 K/V heads already fill 132 multiprocessors: one split, no merge)."""
    wanted = triton.cdiv(4 * num_sms, slots * kv_heads)
    return max(1, min(wanted, triton.cdiv(length, MIN_SPLIT)))


def decode_attention_triton(query, key, value, positions, scale: float, window: int | None = None,
                            num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """The Triton kernel (shapes in decode_attention.py). Every position must be below key.shape[2]; splits,
    block size, warps and stages are tunables (defaults by head size; a configuration that does not fit shared
    memory is shrunk)."""
    b, hq, t, d = query.shape
    if t != 1:
        raise ValueError(f"decode attention takes one query token per slot, got {t}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("decode attention needs the head dimension contiguous in query, key and value")
    block_d = max(16, triton.next_power_of_2(d))
    cache_key = (d, query.dtype)
    default = _WORKING_CONFIGS.get(cache_key) or _default_config(block_d, query.element_size())
    config = (block_n or default[0], num_warps or default[1], num_stages or default[2])
    while True:
        try:
            out = _launch(query, key, value, positions, scale, window, num_splits, block_d, *config)
        except triton.runtime.errors.OutOfResources:
            config = _smaller(config)
            if config is None:
                raise
            continue
        if not any((block_n, num_warps, num_stages)):
            _WORKING_CONFIGS[cache_key] = config
        return out


def _launch(query, key, value, positions, scale, window, num_splits, block_d, block_n, num_warps, num_stages):
    b, hq, _, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    group = hq // hkv
    block_g = max(16, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = choose_splits(b, hkv, length, _num_sms(query.device))
    split_len = triton.cdiv(triton.cdiv(length, num_splits), block_n) * block_n
    num_splits = triton.cdiv(length, split_len)
    single = num_splits == 1
    out = torch.empty(b, 1, hq, d, device=query.device, dtype=query.dtype)
    parts = 1 if single else b * hkv * num_splits * block_g
    m_part = torch.empty(parts, device=query.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty(parts * block_d, device=query.device, dtype=torch.float32)
    positions = positions.to(device=query.device, dtype=torch.int64).contiguous()  # no copy when it is already
    _split_kernel[(num_splits, b * hkv)](
        query, key, value, positions, out, o_part, m_part, l_part,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(2),
        scale * 1.4426950408889634, int(window or 0), hkv, group, split_len,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_N=block_n, HAS_WINDOW=bool(window), SINGLE=single,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    if not single:
        _combine_kernel[(b * hkv,)](
            o_part, m_part, l_part, out, out.stride(0), out.stride(2), hkv, group, num_splits,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=block_g, num_warps=4)
    return out
