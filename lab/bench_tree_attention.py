"""Tree-attention kernel against SDPA with a dense boolean mask and against compiled flex_attention (CUDA).

    python -m lab.bench_tree_attention --out bench_tree_attention.json            # full grid
    python -m lab.bench_tree_attention --quick --out bench_tree_attention.json    # batch 8, 64 nodes only
    python -m lab.bench_tree_attention --check-only                               # kernel == twin, many shapes

Shapes: Qwen3-8B attention (32 query heads, 8 KV heads, head dim 128), bf16; prefix 1k-32k tokens of cache,
16-256 tree nodes, batch 1-16. For each: time (triton.testing.do_bench, median), the effective KV bandwidth
(bytes of the K/V slots read / time), and the error against the fp32 PyTorch twin. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from dflashkit.eval.tree import ancestor_mask, build_tree
from dflashkit.eval.tree_attention import tree_attention_reference
from dflashkit.eval.tree_attention_triton import tree_attention_triton


def make_case(batch, prefix, nodes, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tree = build_tree(0, torch.randn(16, 1000), budget=nodes, top_k=8)
    parents = torch.tensor(tree.parents, device="cuda")
    mask = ancestor_mask(parents).unsqueeze(0)
    prefix_lens = torch.full((batch,), prefix, device="cuda")
    positions = prefix_lens[:, None] + torch.tensor(tree.depths, device="cuda")[None]
    slots = prefix + nodes + 7
    q = torch.randn(batch, heads, nodes, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, kv_heads, slots, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, kv_heads, slots, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v, prefix_lens, mask, positions, prefix


def sdpa_dense(q, k, v, prefix_lens, mask, positions, prefix, scale):
    n = q.shape[2]
    keys, values = k[:, :, :prefix + n], v[:, :, :prefix + n]
    dense = torch.ones(q.shape[0], 1, n, prefix + n, dtype=torch.bool, device=q.device)
    dense[:, 0, :, prefix:] = mask
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=dense, scale=scale,
                                                            enable_gqa=True)


def flex_runner(q, k, v, mask, prefix):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[2]
    tree = mask[0]

    def mask_mod(b, h, q_idx, kv_idx):
        node = (kv_idx - prefix).clamp(0, n - 1)
        return (kv_idx < prefix) | ((kv_idx >= prefix) & tree[q_idx, node])

    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=prefix + n, device="cuda")
    compiled = torch.compile(flex_attention)
    keys, values = k[:, :, :prefix + n].contiguous(), v[:, :, :prefix + n].contiguous()
    return lambda: compiled(q, keys, values, block_mask=block_mask, enable_gqa=True)


def check(scale=0.088) -> list[dict]:
    """Kernel vs fp32 twin over head dims, GQA groups, windows, softcaps, uneven prefixes."""
    rows = []
    for head_dim, heads, kv_heads in ((64, 9, 3), (80, 8, 8), (128, 32, 8), (256, 8, 1)):
        for window, softcap in ((None, None), (300, None), (None, 30.0)):
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v, prefix_lens, mask, positions, prefix = make_case(3, 700, 37, heads, kv_heads, head_dim,
                                                                          dtype)
                prefix_lens = torch.tensor([700, 5, 333], device="cuda")
                positions = prefix_lens[:, None] + (positions - 700)
                ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix_lens, mask, positions, scale,
                                               window, softcap)
                try:
                    out = tree_attention_triton(q, k, v, prefix_lens, mask, positions, scale, window, softcap)
                    err = (out.float() - ref).abs().max().item()
                except Exception as error:  # noqa: BLE001 - reported in the table and the JSON
                    err = float("nan")
                    print(f"check head_dim {head_dim} {dtype}: {type(error).__name__}: {str(error)[:160]}")
                rows.append({"head_dim": head_dim, "heads": heads, "kv_heads": kv_heads, "window": window,
                             "softcap": softcap, "dtype": str(dtype), "max_abs_err": err})
    return rows


def tune(do_bench) -> list[dict]:
    rows = []
    print("tuning (batch 8, 64 nodes): prefix block_m block_n warps stages splits -> ms")
    for prefix in (1024, 8192, 32768):
        q, k, v, prefix_lens, mask, positions, _ = make_case(8, prefix, 64)
        mask, positions, prefix_lens = mask.to(torch.uint8), positions.to(torch.int32), prefix_lens.to(torch.int32)
        for block_m, block_n, warps, stages in ((128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)):
            for splits in (None, 1, 4, 16):
                try:
                    ms = do_bench(lambda: tree_attention_triton(
                        q, k, v, prefix_lens, mask, positions, 0.088, max_prefix_len=prefix, block_m=block_m,
                        block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages), warmup=10, rep=50)
                except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: reported
                    ms = f"failed: {type(error).__name__}"
                rows.append({"prefix": prefix, "block_m": block_m, "block_n": block_n, "warps": warps,
                             "stages": stages, "splits": splits, "ms": ms})
                print(f"  {prefix:6d} {block_m:4d} {block_n:4d} {warps:2d} {stages:2d} {str(splits):>5} -> {ms}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_tree_attention.json")
    parser.add_argument("--quick", action="store_true", help="batch 8, 64 nodes, prefix 1k/8k/32k only")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled flex_attention")
    parser.add_argument("--tune", action="store_true", help="also time kernel configurations (block sizes, "
                        "warps, stages, splits) on batch 8, 64 nodes")
    args = parser.parse_args(argv)
    from triton.testing import do_bench

    checks = check()
    worst = max(r["max_abs_err"] if r["max_abs_err"] == r["max_abs_err"] else float("inf") for r in checks)
    print(f"kernel vs fp32 twin over {len(checks)} shapes: max abs error {worst:.2e}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform(),
              "checks": checks, "rows": []}
    if not args.check_only:
        grid = ([(8, p, 64) for p in (1024, 8192, 32768)] if args.quick else
                [(b, p, n) for b in (1, 8, 16) for p in (1024, 8192, 32768) for n in (16, 64, 256)])
        print(f"{'batch':>5} {'prefix':>6} {'nodes':>5} | {'ours ms':>8} {'sdpa ms':>8} {'flex ms':>8} | "
              f"{'x sdpa':>6} {'GB/s':>7} {'err':>8}")
        for batch, prefix, nodes in grid:
            case = make_case(batch, prefix, nodes)
            q, k, v, prefix_lens, mask, positions, _ = case
            scale = 128 ** -0.5
            ours = lambda: tree_attention_triton(q, k, v, prefix_lens, mask, positions, scale,  # noqa: E731
                                                 max_prefix_len=prefix)
            t_ours = do_bench(ours, warmup=25, rep=100)
            t_sdpa = do_bench(lambda: sdpa_dense(*case, scale), warmup=25, rep=100)
            t_flex = None
            if not args.no_flex:
                try:
                    flex = flex_runner(q, k, v, mask, prefix)
                    flex()
                    t_flex = do_bench(flex, warmup=25, rep=100)
                except Exception as error:  # noqa: BLE001 - reported, the bench goes on
                    t_flex = f"failed: {type(error).__name__}: {str(error)[:120]}"
            ref = sdpa_dense(q.float(), k.float(), v.float(), prefix_lens, mask, positions, prefix, scale)
            err = (ours().float() - ref.transpose(1, 2)).abs().max().item()
            kv_bytes = 2 * batch * k.shape[1] * (prefix + nodes) * k.shape[-1] * k.element_size()
            row = {"batch": batch, "prefix": prefix, "nodes": nodes, "ours_ms": t_ours, "sdpa_dense_ms": t_sdpa,
                   "flex_ms": t_flex, "speedup_vs_sdpa": t_sdpa / t_ours, "kv_gb_per_s": kv_bytes / t_ours / 1e6,
                   "tflops": 4 * batch * q.shape[1] * nodes * (prefix + nodes) * q.shape[-1] / t_ours / 1e9,
                   "max_abs_err": err}
            result["rows"].append(row)
            flex_text = f"{t_flex:8.3f}" if isinstance(t_flex, float) else "  failed"
            print(f"{batch:5d} {prefix:6d} {nodes:5d} | {t_ours:8.3f} {t_sdpa:8.3f} {flex_text} | "
                  f"{row['speedup_vs_sdpa']:6.2f} {row['kv_gb_per_s']:7.0f} {err:8.1e}")
            with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(result, f, indent=2)
    if args.tune:
        result["tuning"] = tune(do_bench)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
