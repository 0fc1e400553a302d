"""The selector candidates' top-k (train/loss.grouped_topk) against torch.topk on one chunk of lm_head logits.

    python bench/bench_topk.py --out bench/results/topk_h200.json       # GPU: a chunk of 2048 rows, SmolLM2's vocab
    python bench/bench_topk.py --rows 64 --out /tmp/topk_cpu.json        # CPU

Each figure is the median of 5 timings of 50 back-to-back calls (one sync at the end) on random bf16 logits,
k = 16 (DFlash2's selector_top_k); every group size's values are checked equal to torch.topk's first.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import seconds_per_call, write_json

from dflashkit.train.loss import TOPK_GROUP, grouped_topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="logit rows of one loss chunk (the trainer's 2048)")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary; Qwen3's is 151936")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(args.rows, args.vocab, device=dev).to(torch.bfloat16)
    ref = torch.topk(x, args.k, dim=-1).values

    def ms(fn) -> float:
        return 1e3 * statistics.median(seconds_per_call(fn, 50, 3, dev) for _ in range(5))

    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=args.rows, vocab=args.vocab,
               k=args.k, default_group=TOPK_GROUP, torch_topk_ms=ms(lambda: torch.topk(x, args.k, dim=-1)))
    for g in args.groups:
        if not torch.equal(grouped_topk(x, args.k, g)[0], ref):
            raise SystemExit(f"group {g}: the values differ from torch.topk's")
        out[f"grouped_{g}_ms"] = ms(lambda g=g: grouped_topk(x, args.k, g))
    print(out)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
