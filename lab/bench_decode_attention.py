"""One layer's decode attention over a slot cache: masked SDPA (the generator's default) against the Triton kernel.

    python -m lab.bench_decode_attention --toy --out /tmp/bench_decode_attention.json
    TRITON_INTERPRET=1 python -m lab.bench_decode_attention --toy --sweep --out /tmp/bench_decode_attention.json
    python -m lab.bench_decode_attention --sweep --out runs/bench/decode_attention_h200.json

Defaults are the SmolLM2-135M testbed at 1,024 slots (3 K/V heads, 3 query heads each, head_dim 64, bf16) over a
cache of --columns columns; slot positions are uniform in [0, columns) with one slot at the last column, so SDPA
attends to every column of every slot (as the generator does when one live slot is that long) and the kernel
reads each slot up to its own position. Rows: ms per call (mean of --iters back-to-back calls after 2 warm-up
ones), the effective K/V read rate of the kernel (bytes of the columns it must read / time), the ratio to SDPA
and the largest difference from the float32 twin. --sweep also times block sizes x warps x stages of the kernel and
reports the fastest.
Without a GPU the "kernel" row is the twin (or the kernel in the interpreter under TRITON_INTERPRET=1).
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from bench.common import seconds_per_call, write_json
from dflashkit import launch
from dflashkit.extract.generation.decode_attention import decode_attention, decode_attention_reference, triton_available
from dflashkit.extract.generation.slot_cache import grouped_attention


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="8 slots x 96 columns, float32 (CPU smoke run)")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per K/V head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--columns", type=int, default=1536, help="the attended length (cache columns)")
    ap.add_argument("--window", type=int, default=None, help="a sliding window (default: full attention)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time kernel configurations (needs the kernel)")
    ap.add_argument("--out", default="bench_decode_attention.json")
    args = ap.parse_args(argv)
    if args.toy:
        args.slots, args.columns, args.dtype, args.iters = 8, 96, "float32", 3
    device = launch.local_device()
    kernel = triton_available(device)
    if args.sweep and not kernel:
        ap.error("--sweep times the Triton kernel: run it on a GPU (or under TRITON_INTERPRET=1)")
    dtype = launch.default_dtype(device, args.dtype)
    g = torch.Generator().manual_seed(0)
    shape = (args.slots, args.kv_heads, args.columns, args.head_dim)
    q = torch.randn(args.slots, args.kv_heads * args.group, 1, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(shape, generator=g).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    positions = torch.randint(0, args.columns, (args.slots,), generator=g)
    positions[0] = args.columns - 1
    positions = positions.to(device)
    scale = args.head_dim ** -0.5
    cols = torch.arange(args.columns, device=device)[None, :]
    visible = cols <= positions[:, None]
    if args.window:
        visible &= cols > positions[:, None] - args.window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))[:, None, None]
    read = int(visible.sum()) * args.kv_heads * args.head_dim * k.element_size() * 2  # K and V columns needed

    twin = decode_attention_reference(q, k, v, positions, scale, args.window).float()
    rows = {}
    sdpa_s = seconds_per_call(lambda: grouped_attention(None, q, k, v, mask, scaling=scale), args.iters, 2, device)
    rows["sdpa (masked, every column)"] = {
        "ms": sdpa_s * 1e3, "error": (grouped_attention(None, q, k, v, mask, scaling=scale)[0].float() - twin)
        .abs().max().item()}
    name = "triton kernel" if kernel else "twin (no kernel here)"
    kernel_s = seconds_per_call(lambda: decode_attention(q, k, v, positions, scale, args.window), args.iters, 2, device)
    rows[name] = {"ms": kernel_s * 1e3,
                  "error": (decode_attention(q, k, v, positions, scale, args.window).float() - twin).abs().max().item()}
    best = None
    if args.sweep:
        from dflashkit.extract.generation.decode_attention_triton import decode_attention_triton

        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            def call():
                return decode_attention_triton(q, k, v, positions, scale, args.window, block_n=block_n,
                                               num_warps=warps, num_stages=stages)
            try:
                seconds = seconds_per_call(call, args.iters, 2, device)
            except Exception as e:  # a configuration beyond the shared memory or registers: skip it
                print(f"block_n {block_n}, {warps} warps, {stages} stages: {type(e).__name__}")
                continue
            if best is None or seconds < best["ms"] / 1e3:
                best = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "ms": seconds * 1e3,
                        "error": (call().float() - twin).abs().max().item()}
        if best:
            rows[f"kernel, best: block_n {best['block_n']}, {best['num_warps']} warps, {best['num_stages']} stages"] \
                = {"ms": best["ms"], "error": best["error"]}
    for r in rows.values():
        r["read_gb_per_s"] = read / (r["ms"] / 1e3) / 1e9
        r["vs_sdpa"] = sdpa_s * 1e3 / r["ms"]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "slots": args.slots, "kv_heads": args.kv_heads, "group": args.group,
              "head_dim": args.head_dim, "columns": args.columns, "window": args.window,
              "mean_position": positions.float().mean().item(), "kv_bytes_needed": read, "rows": rows,
              "best_config": best, "date": time.strftime("%Y-%m-%d %H:%M")}
    write_json(args.out, result)
    print(f"decode attention, {args.slots} slots x {args.kv_heads}x{args.group} heads x d {args.head_dim}, "
          f"{args.columns} columns (mean position {result['mean_position']:.0f}), {args.dtype}, {result['device']}")
    print("| attention | ms | needed K/V GB/s | vs sdpa | max error |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.3f} | {r['read_gb_per_s']:.1f} | {r['vs_sdpa']:.2f}x | {r['error']:.1e} |")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
