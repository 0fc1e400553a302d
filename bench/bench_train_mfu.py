"""Training throughput and MFU of one drafter step at Qwen3-8B drafter dimensions (random weights, one GPU).

    python bench/bench_train_mfu.py [--out results.json] [--seq 3072 --anchors 512 --steps 10]

Counted work (the useful FLOPs of a step, 2 per multiply-add):
- drafter forward: fc over the context; per layer q/o projections and the MLP over the block tokens, k/v
  projections over context + block tokens, attention over the *visible* key pairs only (block-sparse);
- drafter backward: 2x forward (weight and input gradients), except fc, whose input (target features) needs no
  gradient: 1x;
- lm_head forward and input gradient over the B-1 predicted positions of every block (the head is frozen).
MFU = counted FLOPs / step time / peak bf16 dense rate (989 TFLOP/s for an H100/H200 SXM datasheet; the
measured 8192^3 bf16 matmul rate on the same GPU is printed too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.train.anchors import sample_anchors
from dflashkit.train.block_mask import build_block_masks
from dflashkit.train.loss import block_loss, loss_denominator

PEAK_BF16 = 989e12


def count_flops(cfg: DrafterConfig, seq: int, anchors: torch.Tensor, block: int, vocab: int) -> dict:
    H, inter, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tb = anchors.numel() * block
    visible = block * int((anchors + block).sum())  # (query, key) pairs: each block query sees a context keys + B
    fc = 2 * seq * cfg.num_taps * H * H
    per_layer = (2 * tb * H * hq * d * 2  # q and o projections
                 + 2 * (seq + tb) * H * hkv * d * 2  # k and v projections
                 + 2 * tb * 3 * H * inter  # SwiGLU MLP
                 + 2 * 2 * visible * hq * d)  # QK^T and PV over the visible pairs only
    fwd = fc + L * per_layer
    head = 2 * anchors.numel() * (block - 1) * H * vocab
    total = fc * 2 + L * per_layer * 3 + head * 2
    return {"drafter_fwd": fwd, "lm_head_fwd": head, "step_total": total}


def matmul_rate(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * 8192 ** 3 / statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="lm_head/loss rows alive at once")
    ap.add_argument("--compile", action="store_true", help="torch.compile each drafter layer")
    ap.add_argument("--out", default="bench_train_mfu.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=4096, num_target_layers=36, vocab_size=args.vocab, intermediate_size=12288,
                        num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        target_layer_ids=[1, 9, 17, 25, 33], block_size=args.block, mask_token_id=args.vocab - 1,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = build_drafter(cfg, dtype=torch.bfloat16).to(dev).train()
    model.gradient_checkpointing = args.checkpointing
    if args.compile:
        for layer in model.layers:
            layer.compile(dynamic=False)
    embed = torch.randn(args.vocab, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    lm_head = torch.randn(args.vocab, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    seq, B = args.seq, args.block
    ids = torch.randint(0, args.vocab - 1, (seq,), device=dev)
    loss_mask = torch.ones(seq, dtype=torch.bool)
    loss_mask[: seq // 8] = False  # a prompt
    anchors = sample_anchors(loss_mask, args.anchors, torch.Generator().manual_seed(0)).to(dev)
    feats = torch.randn(1, seq, 5 * 4096, device=dev, dtype=torch.bfloat16)
    mask = build_block_masks(anchors, seq, B, cfg.layer_types, backend="flex")
    offs = torch.arange(B, device=dev)
    blk_pos = (anchors[:, None] + offs).reshape(-1)
    block_ids = torch.full((anchors.numel(), B), cfg.mask_token_id, device=dev)
    block_ids[:, 0] = ids[anchors]
    pos = torch.cat([torch.arange(seq, device=dev), blk_pos])[None]
    lab_pos = anchors[:, None] + offs[1:]
    valid = (lab_pos < seq) & loss_mask.to(dev)[lab_pos.clamp(max=seq - 1)]
    labels = ids[lab_pos.clamp(max=seq - 1)]
    flops = count_flops(model.dflash, seq, anchors, B, args.vocab)

    def step():
        noise = torch.nn.functional.embedding(block_ids.reshape(1, -1), embed)
        hidden = model(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=feats)
        h = hidden.reshape(anchors.numel(), B, -1)[:, 1:]
        out = block_loss(h, lm_head, labels, valid, variant="ce", chunk_tokens=args.chunk_tokens)
        (out.loss_sum / loss_denominator(valid, "ce", 7.0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    rate = matmul_rate(dev)
    res = {"step_s_median": med, "step_s_all": times, "tflops": flops["step_total"] / med / 1e12,
           "mfu_vs_989": flops["step_total"] / med / PEAK_BF16,
           "mfu_vs_measured_matmul": flops["step_total"] / med / rate,
           "matmul_tflops": rate / 1e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
           "tokens_per_s": seq / med, "block_tokens_per_s": anchors.numel() * B / med, "flops": flops,
           "args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    json.dump(res, open(args.out, "w"), indent=2)
    print(f"| step ms | TFLOP/s | MFU (989) | MFU (measured {rate/1e12:.0f}) | peak GiB | ctx tok/s |")
    print(f"| {med*1e3:.1f} | {res['tflops']:.0f} | {res['mfu_vs_989']:.1%} | {res['mfu_vs_measured_matmul']:.1%} "
          f"| {res['peak_mem_gib']:.1f} | {res['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
