"""The drafter's packed block attention alone: forward and forward+backward time of each implementation at the
training shape, effective TFLOP/s over the visible pairs, and each one's numbers against the current path.

    python -m lab.bench_block_attention --toy --out runs/bench/block_attention_toy.json          # CPU, tiny
    python -m lab.bench_block_attention --out runs/bench/block_attention_smollm2.json            # one GPU
Defaults: the SmolLM2 testbed drafter's attention (9 query heads, 3 KV heads, head_dim 64, block 16), 16
sequences of 1,024 tokens packed into one micro-batch (16,384 context tokens), up to 512 anchors each
(train/data.collate_blocks draws them with train/anchors.py as training does: ~8,200 blocks, ~131k queries).

Each variant computes what one drafter layer's attention computes in training (drafter/modeling_dflash.py):
queries [1, Q, Hq, d] and RoPE'd keys [1, L+Q, Hkv, d] in the layer's memory layout, values as the two v_proj
outputs (context, block) that the layer concatenates; the output [1, Q, Hq*d] goes to o_proj. Variants:
- flex: exactly as a compiled training layer runs it: the concatenation, transposes and flex_attention with
  the packed BlockMask (train/block_mask.py) in one torch.compile'd function, so inductor may fuse the V
  concatenation into the attention kernel (the reference for the numbers);
- flex_dynamic: flex compiled with dynamic=True (symbolic sizes): what a compiled training layer runs once a
  new micro-batch shape has recompiled it with dynamic shapes, as happens every few steps in training;
- flex_contiguous: q, K and V made contiguous [b, h, S, d] first (eager), then the compiled flex_attention:
  nothing is fused into the kernel;
- flex_ko_<BLOCK_M>x<BLOCK_N>_w<warps>_s<stages>[_tma]: flex_contiguous with explicit forward kernel options
  (``fwd_`` keys; the backward keeps its defaults); BLOCK_M, BLOCK_N divide the mask's 128-token tiles;
- flex_autotune (only when named in --variants): the flex variant compiled with
  mode="max-autotune-no-cudagraphs" (inductor tries its flex configurations; compilation takes minutes);
- split: train/split_attention.py (attention=split) inside one compiled function as in a compiled layer: the
  context part through flex_attention with its log-sum-exp, each block's 16 x 16 part as a batched matmul,
  merged exactly; no partial tiles on the block diagonal;
- split_eager: the same with only the context flex_attention compiled;
- split_ko_<spec>: split with the kernel options of <spec> on its context flex_attention;
- dense: SDPA with the dense bool mask (only where the mask is small: --toy; the reference there);
- layer (only when named in --variants): the drafter's own attention module (DFlashAttention: projections,
  norms, RoPE, the attention, o_proj) as the trainer runs it: float32 weights under bf16 autocast, compiled with
  ``module.compile()`` for static shapes, on the same layout and BlockMask; its own random inputs, so its
  times include the projections and it has no differences column; layer_dynamic: the same compiled with
  dynamic=True (as train/drafter_pass.compile_layers compiles the trainer's layers);
  layer_dynamic_frozen: that with an input that needs no gradient (the first drafter layer's: the noise
  embedding comes from the frozen target embedding), which the trainer compiles as a graph of its own;
  decoder_layer, decoder_layer_dynamic: the whole DFlashDecoderLayer (norms, attention, MLP: the unit the
  trainer compiles) in the same way;
--train-pack K: instead of the layout above, the K-th micro-batch of bench/bench_train_throughput.py's default
pool (its sequences, prompts and anchors), to compare the kernel on exactly what the trainer bench feeds it;
--kernel-profile: also profile 5 forward+backward calls of each GPU variant and record the device time per call
of each kernel whose name has "flex" in it (``kernels`` in the JSON): the attention kernels alone, inside the
layer as in the standalone variants.
On the CPU (--toy) nothing is compiled, flex_attention runs its eager reference (forward only: it has no CPU
backward), split's context part runs its dense twin (split_flex_context: through flex_attention, forward
only), and the reference is dense.
Times: CUDA events (wall clock on the CPU), median of --repeats after --warmup calls (compilation happens
there). FLOPs: 4*d per visible (query, key) pair and query head forward, 2.5x that backward. Differences: max
|out - ref| and max |grad - ref grad| for dq, dk, dv (one fixed output gradient); on the GPU also against a
float32 flex_attention run of the same inputs, which tells which bf16 variant is closer to exact.
Every variant runs in its own try block: one that fails records its error and the others still run; the JSON
is rewritten after each variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_train_throughput import kernel_times, train_pack
from bench.common import timed
from dflashkit import launch
from dflashkit.train.block_mask import dense_block_mask, flex_block_mask, split_block_mask
from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.split_attention import SplitBlockMask

KO_SETS = ["128x64_w4_s3", "64x128_w4_s3", "128x128_w8_s3", "64x64_w4_s3", "128x128_w4_s3_tma"]
GPU_VARIANTS = ["flex", "flex_dynamic", "flex_contiguous", *(f"flex_ko_{s}" for s in KO_SETS), "split", "split_eager",
                "split_ko_128x64_w4_s3", "split_ko_64x128_w4_s3"]  # flex_autotune: on request (slow to compile)
CPU_VARIANTS = ["dense", "flex", "split", "split_flex_context"]
LAYER_VARIANTS = ["layer", "layer_dynamic", "layer_dynamic_frozen", "decoder_layer", "decoder_layer_dynamic"]


def kernel_options(spec: str) -> dict:
    """"128x64_w4_s3[_tma]" -> forward-only flex_attention kernel options."""
    parts = spec.split("_")
    m, n = (int(x) for x in parts[0].split("x"))
    opts = {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": int(parts[1][1:]), "fwd_num_stages": int(parts[2][1:])}
    if "tma" in parts[3:]:
        opts["USE_TMA"] = True
    return opts


def make_layout(num_seqs: int, min_len: int, max_len: int, num_anchors: int, block_size: int, seed: int):
    """A packed micro-batch of random chat-shaped sequences: a prompt (10-40% of the tokens, untrained), then
    the answer (trained); anchors drawn as training draws them."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_seqs):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = int(n * (0.1 + 0.3 * torch.rand(1, generator=g)))
        mask = torch.arange(n) >= prompt
        samples.append({"input_ids": torch.zeros(n, dtype=torch.long), "loss_mask": mask,
                        "hidden": torch.zeros(n, 1), "index": i})
    return collate_blocks(samples, CollateOptions(block_size, 0, num_anchors, seed), check_finite=False)


def visible_pairs(anchors, starts, block_size: int, window: int | None) -> int:
    """Visible (query, key) pairs of the packed mask, in closed form (per query head)."""
    a, s = anchors.long().cpu(), starts.long().cpu()
    i = torch.arange(block_size)[None, :]
    if window is None:
        ctx = (a - s)[:, None].expand(-1, block_size)
        blk = torch.full_like(ctx, block_size)
    else:
        lo = torch.maximum(s[:, None], a[:, None] + i - window + 1)
        ctx = (a[:, None] - lo).clamp_min(0)
        blk = torch.minimum(i + 1, torch.tensor(window)).expand(a.numel(), -1)
    return int(ctx.sum() + blk.sum())


def milliseconds(fn, repeats: int, warmup: int, device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls ``fn()`` after ``warmup`` untimed ones (bench/common.timed)."""
    return [1e3 * s for s in timed(lambda i: fn(), repeats, warmup, device)]


def build_variant(name: str, *, L: int, Q: int, hkv: int, d: int, scale: float, gpu: bool, masks: dict):
    """(function of (q, k, vc, vb) -> out [1, Q, Hq*d], whether it has a backward here)."""
    from torch.nn.attention.flex_attention import flex_attention

    compile_ = (lambda f, **kw: torch.compile(f, dynamic=False, **kw)) if gpu else (lambda f, **kw: f)
    gqa = True

    def concat_v(vc, vb):
        return torch.cat([vc, vb], dim=1).view(1, L + Q, hkv, d).transpose(1, 2)

    def finish(out):
        return out.transpose(1, 2).reshape(1, Q, -1)

    if name in ("flex", "flex_autotune", "flex_dynamic"):
        mask = masks["flex"]

        def fused(q, k, vc, vb, mask):
            return finish(flex_attention(q.transpose(1, 2), k.transpose(1, 2), concat_v(vc, vb), block_mask=mask,
                                         scale=scale, enable_gqa=gqa))

        if name == "flex_dynamic":  # symbolic shapes, as the trainer's compiled layers end up after a recompile
            fn = torch.compile(fused, dynamic=True) if gpu else fused
        else:
            fn = compile_(fused, mode="max-autotune-no-cudagraphs") if name == "flex_autotune" else compile_(fused)
        return (lambda q, k, vc, vb: fn(q, k, vc, vb, mask)), gpu
    if name == "flex_contiguous" or name.startswith("flex_ko_"):
        mask, flex = masks["flex"], compile_(flex_attention)
        kw = {"kernel_options": kernel_options(name[len("flex_ko_"):])} if name.startswith("flex_ko_") else {}
        if kw and not gpu:
            raise RuntimeError("kernel options are Triton settings: CUDA only")

        def contiguous(q, k, vc, vb):
            qc, kc = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            return finish(flex(qc, kc, concat_v(vc, vb).contiguous(), block_mask=mask, scale=scale, enable_gqa=gqa,
                               **kw))

        return contiguous, gpu
    if name in ("split", "split_eager", "split_flex_context") or name.startswith("split_ko_"):
        mask = masks["split_flex" if name == "split_flex_context" else "split"]
        if name.startswith("split_ko_"):
            if not gpu:
                raise RuntimeError("kernel options are Triton settings: CUDA only")
            mask = SplitBlockMask(mask.context_mask, mask.ctx_len, mask.block_size, mask.sliding_window,
                                  kernel_options(name[len("split_ko_"):]))

        def split(q, k, vc, vb, mask):
            return finish(mask.attend(q.transpose(1, 2), k.transpose(1, 2), concat_v(vc, vb), scale))

        fn = split if name == "split_eager" else compile_(split)
        has_backward = gpu or torch.is_tensor(mask.context_mask)
        return (lambda q, k, vc, vb: fn(q, k, vc, vb, mask)), has_backward
    if name == "dense":
        mask = masks["dense"]

        def dense(q, k, vc, vb):
            rep = q.shape[2] // hkv
            kk, vv = k.transpose(1, 2).repeat_interleave(rep, 1), concat_v(vc, vb).repeat_interleave(rep, 1)
            return finish(F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, scale=scale))

        return dense, True
    raise ValueError(f"unknown variant {name!r}; the variants: {GPU_VARIANTS + ['dense']}")


def layer_case(*, L: int, Q: int, hq: int, hkv: int, d: int, mask, gpu: bool, dev, dynamic: bool = False,
               frozen_input: bool = False, whole: bool = False, intermediate: int = 1536):
    """(forward, forward+backward) callables of the drafter's DFlashAttention (whole: its DFlashDecoderLayer, the
    unit the trainer compiles) as a compiled training layer."""
    from transformers import Qwen3Config

    from dflashkit.drafter.modeling_dflash import DFlashAttention, DFlashDecoderLayer

    cfg = Qwen3Config(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      num_hidden_layers=1, intermediate_size=intermediate)
    torch.manual_seed(0)
    attn = (DFlashDecoderLayer if whole else DFlashAttention)(cfg, 0)
    attn = attn.to(dev).train().requires_grad_(gpu)  # float32, as mixed precision keeps them
    if gpu:
        attn.compile(dynamic=dynamic)
    g = torch.Generator(device=dev).manual_seed(1)
    block = torch.randn(1, Q, hq * d, generator=g, device=dev, requires_grad=gpu and not frozen_input)
    context = torch.randn(1, L, hq * d, generator=g, device=dev, requires_grad=gpu)
    angles = torch.rand(1, L + Q, d, generator=g, device=dev) * 6.28
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(1, Q, hq * d, generator=g, device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def forward():
        with autocast:
            return attn(block, context, cos, sin, mask)

    def forward_backward():
        forward().backward(grad)

    return forward, (forward_backward if gpu else None)


def max_diffs(out, grads, ref) -> dict:
    if ref is None:
        return {}
    r = {"out": float((out.detach().float() - ref[0].float()).abs().max())}
    if grads is not None and ref[1] is not None:
        for key, a, b in zip(("dq", "dk", "dvc", "dvb"), grads, ref[1]):
            r[key] = float((a.float() - b.float()).abs().max())
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="tiny sizes on the CPU (no compilation)")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate-size", type=int, default=1536, help="the MLP of the decoder_layer variants")
    ap.add_argument("--sliding-window", type=int, default=None, help="time a sliding-attention layer instead")
    ap.add_argument("--variants", default=None, help="comma list (default: all for the device)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--train-pack", type=int, default=None,
                    help="the layout of this micro-batch of bench_train_throughput.py's default pool instead")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="GPU: also record the device time per call of each flex kernel of each variant")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.toy:
        args.num_seqs, args.min_len, args.max_len, args.num_anchors = 3, 60, 200, 24
        args.heads, args.kv_heads, args.head_dim, args.repeats, args.warmup = 3, 1, 16, 3, 1
        args.intermediate_size = 4 * args.heads * args.head_dim
    dev = launch.local_device(args.device or ("cpu" if args.toy else None))
    gpu = dev.type == "cuda"
    dtype = launch.default_dtype(dev)
    if gpu:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    B, hq, hkv, d, W = args.block_size, args.heads, args.kv_heads, args.head_dim, args.sliding_window
    if args.train_pack is None:
        layout = make_layout(args.num_seqs, args.min_len, args.max_len, args.num_anchors, B, args.seed).to(dev)
    else:
        layout = train_pack(args.train_pack, B, args.num_anchors, toy=args.toy).to(dev)
        args.num_seqs = len(layout.context_offsets) - 1
    anchors, starts, L = layout.anchors, layout.context_start, layout.ctx_len
    N = anchors.numel()
    Q = N * B
    pairs = visible_pairs(anchors, starts, B, W)
    flops_fwd = 4.0 * d * hq * pairs
    scale = d ** -0.5
    if W is not None and W < 1:
        ap.error("--sliding-window must be >= 1")

    masks, mask_ms = {}, {}
    builders = {"flex": lambda: flex_block_mask(anchors, L, B, W, starts),
                "split": lambda: split_block_mask(anchors, L, B, W, starts)}
    if not gpu:
        builders["split_flex"] = lambda: split_block_mask(anchors, L, B, W, starts, context="flex")
    if not gpu or Q * (L + Q) <= 1 << 28:
        builders["dense"] = lambda: dense_block_mask(anchors, L, B, W, starts)
    for key, build in builders.items():
        masks[key] = build()
        mask_ms[key] = statistics.median(milliseconds(build, 5, 1, dev))
    if "dense" in masks and int(masks["dense"].sum()) != pairs:
        raise SystemExit(f"visible pairs: closed form {pairs}, dense mask {int(masks['dense'].sum())}")
    names = args.variants.split(",") if args.variants else (GPU_VARIANTS if gpu else CPU_VARIANTS)

    g = torch.Generator(device=dev).manual_seed(args.seed)
    base = {"q": torch.randn(1, Q, hq, d, generator=g, device=dev), "k": torch.randn(1, L + Q, hkv, d, generator=g,
                                                                                     device=dev),
            "vc": torch.randn(1, L, hkv * d, generator=g, device=dev), "vb": torch.randn(1, Q, hkv * d, generator=g,
                                                                                          device=dev)}
    grad_out = torch.randn(1, Q, hq * d, generator=g, device=dev).to(dtype)

    def inputs(dt):
        return [t.to(dt).requires_grad_(True) for t in base.values()]

    results = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "args": vars(args),
               "layout": {"sequences": args.num_seqs, "ctx_len": L, "real_ctx_tokens": layout.num_tokens,
                          "blocks": N, "queries": Q, "keys": L + Q, "visible_pairs_per_head": pairs,
                          "forward_gflop": flops_fwd / 1e9}, "mask_build_ms": mask_ms, "variants": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    exact = None
    if gpu:  # float32 flex_attention (compiled, contiguous) of the same inputs: the closest to exact at this size
        try:
            fn, _ = build_variant("flex_contiguous", L=L, Q=Q, hkv=hkv, d=d, scale=scale, gpu=gpu, masks=masks)
            x = inputs(torch.float32)
            out = fn(*x)
            exact = (out.detach(), torch.autograd.grad(out, x, grad_out.float()))
        except Exception as e:  # noqa: BLE001 - recorded, the bf16 variants still run
            results["fp32_reference_error"] = f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache()
    ref = None
    for name in names:
        r = results["variants"][name] = {}
        if name in LAYER_VARIANTS:
            try:
                fwd_fn, fb_fn = layer_case(L=L, Q=Q, hq=hq, hkv=hkv, d=d, mask=masks["flex"], gpu=gpu, dev=dev,
                                           dynamic="dynamic" in name, frozen_input=name.endswith("_frozen"),
                                           whole=name.startswith("decoder_"),
                                           intermediate=args.intermediate_size)
                r["fwd_ms"] = statistics.median(milliseconds(fwd_fn, args.repeats, args.warmup, dev))
                r["fwd_tflops"] = flops_fwd / r["fwd_ms"] / 1e9  # the attention's FLOPs only, as for the others
                if fb_fn is not None:
                    r["fwd_bwd_ms"] = statistics.median(milliseconds(fb_fn, args.repeats, args.warmup, dev))
                    r["fwd_bwd_tflops"] = 3.5 * flops_fwd / r["fwd_bwd_ms"] / 1e9
                    if args.kernel_profile:
                        r["kernels"] = kernel_times(fb_fn)
                r["max_abs_diff_vs_ref"] = r["max_abs_diff_vs_fp32"] = {}
            except Exception as e:  # noqa: BLE001 - recorded, the others still run
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc(limit=4)
            out_path.write_text(json.dumps(results, indent=2))
            continue
        try:
            fn, has_backward = build_variant(name, L=L, Q=Q, hkv=hkv, d=d, scale=scale, gpu=gpu, masks=masks)
            x = inputs(dtype)
            if not has_backward:
                x = [t.detach() for t in x]
            out = fn(*x)
            grads = torch.autograd.grad(out, x, grad_out) if has_backward else None
            if ref is None:
                ref = (out.detach(), grads)
                results["reference"] = name
            r["max_abs_diff_vs_ref"] = max_diffs(out, grads, ref)
            r["max_abs_diff_vs_fp32"] = max_diffs(out, grads, exact)
            del out, grads
            fwd = milliseconds(lambda: fn(*x), args.repeats, args.warmup, dev)
            r["fwd_ms"] = statistics.median(fwd)
            r["fwd_tflops"] = flops_fwd / r["fwd_ms"] / 1e9
            if has_backward:
                fb = milliseconds(lambda: torch.autograd.grad(fn(*x), x, grad_out), args.repeats, args.warmup, dev)
                r["fwd_bwd_ms"] = statistics.median(fb)
                r["fwd_bwd_tflops"] = 3.5 * flops_fwd / r["fwd_bwd_ms"] / 1e9
                if gpu and args.kernel_profile:
                    r["kernels"] = kernel_times(lambda: torch.autograd.grad(fn(*x), x, grad_out))
            else:
                r["note"] = "forward only: flex_attention has no backward on the CPU"
        except Exception as e:  # noqa: BLE001 - one variant's failure is a result, the others still run
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc(limit=4)
        if gpu:
            torch.cuda.empty_cache()
        out_path.write_text(json.dumps(results, indent=2))
    print_table(results)
    if ref is None or "error" in results["variants"].get(results.get("reference", ""), {"error": 1}):
        raise SystemExit(1)


def print_table(r: dict) -> None:
    lay = r["layout"]
    print(f"{r['device']}, torch {r['torch']}, {r['dtype']}: {lay['sequences']} sequences, context {lay['ctx_len']}, "
          f"{lay['blocks']} blocks ({lay['queries']} queries x {lay['keys']} keys), "
          f"{lay['visible_pairs_per_head']:,} visible pairs per head, {lay['forward_gflop']:.1f} GFLOP forward; "
          f"reference: {r.get('reference')}; mask build ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["mask_build_ms"].items()))
    print("| variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | max diff vs ref (out / grads) "
          "| vs fp32 (out / grads) |")
    print("|---|---|---|---|---|---|---|")

    def diffs(dd):
        if not dd:
            return "-"
        grads = [v for k, v in dd.items() if k != "out"]
        return f"{dd['out']:.2e} / {max(grads):.2e}" if grads else f"{dd['out']:.2e} / -"

    for name, v in r["variants"].items():
        if "error" in v:
            print(f"| {name} | failed: {v['error'][:100]} | | | | | |")
            continue
        fb = f"{v['fwd_bwd_ms']:.3f} | {v['fwd_bwd_tflops']:.1f}" if "fwd_bwd_ms" in v else "- | -"
        print(f"| {name} | {v['fwd_ms']:.3f} | {v['fwd_tflops']:.1f} | {fb} | {diffs(v['max_abs_diff_vs_ref'])} "
              f"| {diffs(v['max_abs_diff_vs_fp32'])} |")
    for name, v in r["variants"].items():
        for kernel, ms in v.get("kernels", {}).items():
            print(f"{name}: {kernel[:90]} {ms:.3f} ms per call")


if __name__ == "__main__":
    main()
