"""The selector candidates' top-k (train/loss.grouped_topk) against torch.topk on one chunk of lm_head logits.

    python bench/bench_topk.py --out bench/results/topk_h200.json       # GPU: a chunk of 2048 rows, SmolLM2's vocab
    python bench/bench_topk.py --rows 64 --out /tmp/topk_cpu.json        # CPU

Each figure is the median of 5 timings of 50 back-to-back calls (one sync at the end) on random bf16 logits,
k = 16 (DFlash2's selector_top_k); every group size's values are checked equal to torch.topk's first.
Also the loss pass's whole candidate step at the default group, both compiled as the trainer compiles them:
``row_stats_then_topk`` (the row statistics kernel, then grouped_topk reading the logits again for its group
maxima) against ``grouped_stats_then_topk`` (one kernel gives the statistics and the group maxima; grouped_topk
starts from them); their outputs are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import seconds_per_call, write_json

from dflashkit.train.loss import TOPK_GROUP, grouped_topk, logit_statistics


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
    labels = torch.randint(0, args.vocab, (args.rows,), device=dev)
    row_stats, grouped_stats = logit_statistics(False, True), logit_statistics(True, True)

    def row_path():
        return row_stats(x, labels, torch.float32), grouped_topk(x, args.k)

    def grouped_path():
        lse, tgt, arg, gmax = grouped_stats(x, labels, torch.float32, TOPK_GROUP)
        return (lse, tgt, arg), grouped_topk(x, args.k, group_max=gmax)

    (a_stats, a_top), (b_stats, b_top) = row_path(), grouped_path()
    torch.testing.assert_close(b_stats[0], a_stats[0], rtol=1e-5, atol=1e-5)
    if not (torch.equal(a_stats[2], b_stats[2]) and torch.equal(a_top[0], b_top[0])):
        raise SystemExit("the grouped statistics' argmax or candidates differ from the row path's")
    out["row_stats_then_topk_ms"] = ms(row_path)
    out["grouped_stats_then_topk_ms"] = ms(grouped_path)
    out["row_stats_ms"] = ms(lambda: row_stats(x, labels, torch.float32))
    out["grouped_stats_ms"] = ms(lambda: grouped_stats(x, labels, torch.float32, TOPK_GROUP))
    print(out)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
