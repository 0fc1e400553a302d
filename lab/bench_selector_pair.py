"""DFlash2's pairwise selector term, forward and backward, by the kernels (train/selector_pair.py) against the
model's torch expression (the candidates' codebook rows gathered, then a batched matmul), at one micro-batch.

    python -m lab.bench_selector_pair --out runs/bench/selector_pair_h200.json   # GPU: the testbed's shape
    python -m lab.bench_selector_pair --positions 512 --out /tmp/selector_pair_cpu.json  # CPU: torch only

The testbed's micro-batch of 8,192 tokens holds ~5,200 blocks, so ~78k draft positions (bench_train_throughput's
packs); k 16, rank 256 and SmolLM2's 49,152 tokens are DFlash2's defaults. The gates, ids and codebook are random
(ids uniform over the vocabulary, or ``--zipf`` for a skewed draw like real candidates, whose common tokens make
the codebook gradient's atomics collide). Figures are medians of 5 timings of 10 back-to-back calls of forward
+ backward under bf16 autocast (``torch_ms``, ``kernel_ms``), and of the forward alone; the kernels' scores and
gradients are checked against torch's first (bf16 rounding). Peak memory of each path is reported on a GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import seconds_per_call, write_json
from dflashkit.train.selector_pair import kernel_fits, pair_reference, pair_term


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", type=int, default=78_000, help="draft positions of one micro-batch")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--zipf", action="store_true", help="ids drawn with P(rank i) ~ 1/(i+1) instead of uniform")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    gate = torch.randn(args.positions, args.rank, device=dev, generator=g)
    book = 0.02 * torch.randn(args.vocab, args.rank, device=dev, generator=g)
    if args.zipf:
        weights = 1.0 / torch.arange(1, args.vocab + 1, device=dev, dtype=torch.float32)
        ids = torch.multinomial(weights, args.positions * args.k, replacement=True, generator=g)
        ids = ids.view(args.positions, args.k)
    else:
        ids = torch.randint(0, args.vocab, (args.positions, args.k), device=dev, generator=g)
    gate.requires_grad_(True)
    book.requires_grad_(True)
    grad = torch.randn(args.positions, args.k, device=dev, generator=g).to(torch.bfloat16)

    def step(fn, backward=True):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = fn(gate, ids, book)
        if backward:
            gate.grad = book.grad = None
            out.backward(grad.to(out.dtype))
        return out

    def ms(fn) -> float:
        return 1e3 * statistics.median(seconds_per_call(fn, 10, 2, dev) for _ in range(5))

    def peak(fn) -> float | None:
        if dev != "cuda":
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", positions=args.positions, k=args.k,
               rank=args.rank, vocab=args.vocab, ids="zipf" if args.zipf else "uniform",
               torch_ms=ms(lambda: step(pair_reference)), torch_forward_ms=ms(lambda: step(pair_reference, False)),
               torch_peak_mib=peak(lambda: step(pair_reference)))
    if dev == "cuda" and kernel_fits(gate, ids, book):
        ref = step(pair_reference).float()
        ref_grads = gate.grad.clone(), book.grad.clone()
        got = step(pair_term).float()
        for name, a, b in (("scores", got, ref), ("gate gradient", gate.grad, ref_grads[0]),
                           ("codebook gradient", book.grad, ref_grads[1])):
            if (a - b).abs().max() > 2e-2 * b.abs().max():
                raise SystemExit(f"the kernels' {name} differ from torch's beyond bf16 rounding")
        out.update(kernel_ms=ms(lambda: step(pair_term)), kernel_forward_ms=ms(lambda: step(pair_term, False)),
                   kernel_peak_mib=peak(lambda: step(pair_term)))
        out["kernel_vs_torch"] = out["torch_ms"] / out["kernel_ms"]
    else:
        out["kernel"] = "not timed: needs a CUDA device (the interpreter would take hours here)"
    print(out)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
