"""Training throughput and MFU of one drafter step at Qwen3-8B drafter dimensions (random weights, one GPU).

    python -m lab.bench_train_mfu [--out results.json] [--seq 3072 --anchors 512 --steps 10]
    python -m lab.bench_train_mfu --toy --out /tmp/bench_train_mfu_toy.json      # CPU, the toy Qwen3, seconds

The step is this script's own, on one sequence (no packing, no accelerate, ce loss): the drafter's forward,
backward and AdamW alone at a fixed shape, as the first MFU table of lab/BENCHMARKS.md measured them. The trainer's
step (train/train_step.py) at these dimensions is ``bench/bench_train_throughput.py --qwen3-8b``.
The shape is bench/common.QWEN3_8B (``--toy``: QWEN3_TOY, with a short sequence and few anchors); the device and
dtype are dflashkit/launch.py's (this rank's GPU in bf16, else the CPU in fp32).

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
import statistics

import torch

from bench.common import PEAK_BF16, matmul_rate, qwen3_8b_config, timed, write_json
from dflashkit import launch
from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.train.anchors import sample_anchors
from dflashkit.train.block_mask import build_block_masks
from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import loss_denominator


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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="the toy Qwen3 on the CPU: 96 tokens, 8 anchors, 2 layers")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=None, help="default: the target shape's (151936)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="lm_head/loss rows alive at once")
    ap.add_argument("--compile", action="store_true", help="torch.compile each drafter layer")
    ap.add_argument("--out", default="bench_train_mfu.json")
    args = ap.parse_args(argv)
    if args.toy:
        for k, v in dict(seq=96, anchors=8, block=4, layers=2, steps=2, warmup=1).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    dev = launch.local_device("cpu" if args.toy else None)
    dtype = launch.default_dtype(dev)
    gpu = dev.type == "cuda"
    torch.manual_seed(0)
    target = qwen3_8b_config(toy=args.toy, **({"vocab_size": args.vocab} if args.vocab else {}))
    vocab, H = target.vocab_size, target.hidden_size
    taps = [1, 9, 17, 25, 33] if not args.toy else [1, 3, 5]
    cfg = DrafterConfig.for_target(target, num_hidden_layers=args.layers, block_size=args.block,
                                   target_layer_ids=taps, mask_token_id=vocab - 1)
    model = build_drafter(cfg, dtype=dtype).to(dev).train()
    model.gradient_checkpointing = args.checkpointing
    if args.compile:
        for layer in model.layers:
            layer.compile(dynamic=False)
    embed = torch.randn(vocab, H, device=dev, dtype=dtype) * 0.02
    lm_head = torch.randn(vocab, H, device=dev, dtype=dtype) * 0.02
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)

    seq, B = args.seq, args.block
    ids = torch.randint(0, vocab - 1, (seq,), device=dev)
    loss_mask = torch.ones(seq, dtype=torch.bool)
    loss_mask[: seq // 8] = False  # a prompt
    anchors = sample_anchors(loss_mask, args.anchors, torch.Generator().manual_seed(0)).to(dev)
    feats = torch.randn(1, seq, len(taps) * H, device=dev, dtype=dtype)
    mask = build_block_masks(anchors, seq, B, cfg.layer_types, backend="flex" if gpu else "dense")
    offs = torch.arange(B, device=dev)
    blk_pos = (anchors[:, None] + offs).reshape(-1)
    block_ids = torch.full((anchors.numel(), B), cfg.mask_token_id, device=dev)
    block_ids[:, 0] = ids[anchors]
    pos = torch.cat([torch.arange(seq, device=dev), blk_pos])[None]
    lab_pos = anchors[:, None] + offs[1:]
    valid = (lab_pos < seq) & loss_mask.to(dev)[lab_pos.clamp(max=seq - 1)]
    labels = ids[lab_pos.clamp(max=seq - 1)]
    flops = count_flops(model.dflash, seq, anchors, B, vocab)
    loss = LossSettings("ce", chunk_tokens=args.chunk_tokens)

    def step(i):
        noise = torch.nn.functional.embedding(block_ids.reshape(1, -1), embed)
        hidden = model(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=feats)
        h = hidden.reshape(anchors.numel(), B, -1)[:, 1:]
        out = block_loss(h, lm_head, labels, valid, loss)
        (out.loss_sum / loss_denominator(valid, "ce", 7.0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if gpu:
        timed(step, 0, args.warmup, dev)  # compiled and warm before the peak memory is counted
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, args.steps, 0 if gpu else args.warmup, dev)
    med = statistics.median(times)
    rate = matmul_rate(dev)  # None off the GPU: no MFU against it
    res = {"step_s_median": med, "step_s_all": times, "tflops": flops["step_total"] / med / 1e12,
           "mfu_vs_989": flops["step_total"] / med / PEAK_BF16 if gpu else None,
           "mfu_vs_measured_matmul": flops["step_total"] / med / rate if rate else None,
           "matmul_tflops": rate / 1e12 if rate else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2 ** 30 if gpu else None,
           "tokens_per_s": seq / med, "block_tokens_per_s": anchors.numel() * B / med, "flops": flops,
           "args": vars(args), "gpu": torch.cuda.get_device_name(dev) if gpu else "cpu", "torch": torch.__version__}
    write_json(args.out, res)
    mfu = [f"{res[k]:.1%}" if res[k] is not None else "-" for k in ("mfu_vs_989", "mfu_vs_measured_matmul")]
    print(f"| step ms | TFLOP/s | MFU (989) | MFU (measured {(rate or 0) / 1e12:.0f}) | peak GiB | ctx tok/s |")
    print(f"| {med*1e3:.1f} | {res['tflops']:.0f} | {mfu[0]} | {mfu[1]} | {res['peak_mem_gib'] or 0:.1f} "
          f"| {res['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
