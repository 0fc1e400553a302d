"""DFlash2's in-block convolution, forward and backward, by the kernels (train/dynamic_conv.py) against the
model's torch expression, eager and compiled, at one micro-batch of the testbed.

    python -m lab.bench_dynamic_conv --out runs/bench/dynamic_conv_h200.json    # GPU: the testbed's shape
    python -m lab.bench_dynamic_conv --blocks 64 --out /tmp/dynamic_conv_cpu.json  # CPU: torch only

A testbed micro-batch of 8,192 tokens holds ~5,400 blocks of 16 (~86k block positions; bench_train_throughput's
packs), width 576, and DFlash2's defaults convolve them with 2 taps over groups of 16 channels. Each DFlash2 layer
runs four such convolutions (two around its attention, two around its MLP), so a step of two micro-batches
through 5 layers runs 40. The rows, taps and gradient are random, in bf16 as under the trainer's autocast (the
base taps float32, as the parameter). Figures: medians of 5 timings of 10 back-to-back calls of forward +
backward (``*_ms``) and of the forward alone (``*_forward_ms``) for ``eager`` (the torch expression),
``compiled`` (that expression through torch.compile, as inductor compiles it inside a layer) and ``kernel``; the
kernels' value and gradients are checked against the compiled expression's first (bf16 rounding). ``--sweep``
also times the kernels at other tiles (rows x channels a program, warps; ``kernel_tiles``; the default tile is
train/dynamic_conv_triton.TILE).
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from bench.common import seconds_per_call, write_json
from dflashkit.drafter.modeling_dflash2 import grouped_dynamic_causal_conv
from dflashkit.train.dynamic_conv import dynamic_conv, kernel_fits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=5376, help="blocks of one micro-batch (5,376 x 16 = 86,016 rows)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--taps", type=int, default=2)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--sweep", action="store_true", help="also time the kernels at other tiles (GPU)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    rows, width, groups = args.blocks * args.block_size, args.hidden, args.hidden // args.group
    x = torch.randn(1, rows, width, device=dev, generator=g).to(dtype).requires_grad_()
    # both tap sets of a kernel projection's output, the second read through its strided view as finish() does
    proj = (0.3 * torch.randn(1, rows, 2, args.taps, groups, device=dev, generator=g)).to(dtype).requires_grad_()
    base = torch.randn(args.taps, width, device=dev, generator=g).requires_grad_()
    grad = torch.randn(1, rows, width, device=dev, generator=g).to(dtype)
    compiled = torch.compile(grouped_dynamic_causal_conv, dynamic=False)

    def step(fn, backward=True):
        out = fn(x, proj[..., 1, :, :], base, args.group, args.block_size)
        if backward:
            x.grad = proj.grad = base.grad = None
            out.backward(grad)
        return out

    def ms(fn) -> float:
        return 1e3 * statistics.median(seconds_per_call(fn, 10, 2, dev) for _ in range(5))

    forms = {"eager": grouped_dynamic_causal_conv, "compiled": compiled}
    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=rows, hidden=width,
               taps=args.taps, group=args.group, block_size=args.block_size, dtype=str(dtype).split(".")[-1])
    if dev == "cuda" and kernel_fits(x, proj[..., 1, :, :], base, args.group, args.block_size):
        ref = step(compiled).float()
        ref_grads = x.grad.float(), proj.grad.float(), base.grad.clone()
        got = step(dynamic_conv).float()
        for name, a, b in (("value", got, ref), ("x gradient", x.grad.float(), ref_grads[0]),
                           ("tap gradient", proj.grad.float(), ref_grads[1]),
                           ("base gradient", base.grad, ref_grads[2])):
            if (a - b).abs().max() > 2e-2 * b.abs().max():
                raise SystemExit(f"the kernels' {name} differs from the compiled expression's beyond bf16 rounding")
        forms["kernel"] = dynamic_conv
    else:
        out["kernel"] = "not timed: needs a CUDA device (the interpreter would take hours here)"
    for name, fn in forms.items():
        out[f"{name}_ms"] = ms(lambda fn=fn: step(fn))
        out[f"{name}_forward_ms"] = ms(lambda fn=fn: step(fn, False))
    if "kernel_ms" in out:
        out["kernel_vs_compiled"] = out["compiled_ms"] / out["kernel_ms"]
        out["saved_per_step_ms"] = 40 * (out["compiled_ms"] - out["kernel_ms"])  # 4 a layer, 5 layers, 2 micro
    if "kernel_ms" in out and args.sweep:
        from dflashkit.train.dynamic_conv_triton import TILE

        default, out["kernel_tiles"] = dict(TILE), []
        for rows, channels, warps in itertools.product((32, 64, 128), (64, 128), (4, 8)):
            TILE.update(rows=rows, channels=channels, num_warps=warps)
            out["kernel_tiles"].append(dict(TILE, ms=ms(lambda: step(dynamic_conv)),
                                            forward_ms=ms(lambda: step(dynamic_conv, False))))
        TILE.update(default)
    print(out)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
