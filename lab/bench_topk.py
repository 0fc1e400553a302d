"""The selector candidates' top-k (train/grouped_topk.py) against torch.topk on one chunk of lm_head logits.

    python -m lab.bench_topk --out runs/bench/topk_h200.json       # GPU: a chunk of 2048 rows, SmolLM2's vocab
    python -m lab.bench_topk --rows 64 --out /tmp/topk_cpu.json        # CPU

Each figure is the median of 5 timings of 50 back-to-back calls (one sync at the end) on random bf16 logits,
k = 16 (DFlash2's selector_top_k); every path's values are checked equal to torch.topk's first (and the kernel's
ids to point at them). Per group size: ``grouped_{g}_ms`` the torch path (``grouped_topk_reference``) and
``kernel_{g}_ms`` the Triton kernel (train/grouped_topk_triton.py), both finding the group maxima themselves.
At the default group, the loss pass's case, the maxima given: ``given_max_torch_ms`` and ``given_max_kernel_ms``
(and ``given_max_kernel_w{n}_ms`` per ``--warps``). The kernel is timed on a CUDA device only (the interpreter
would take hours here); elsewhere ``kernel`` says why its figures are missing.
Also the loss pass's whole candidate step at the default group, the statistics compiled as the trainer compiles them:
``row_stats_then_topk`` (the row statistics kernel, then the torch grouped path reading the logits again for its
group maxima) against ``grouped_stats_then_topk`` (one kernel gives the statistics and the group maxima; the torch
grouped path starts from them) and ``grouped_stats_then_kernel`` (the same with the Triton kernel, what the
trainer runs on a GPU); their outputs are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import seconds_per_call, write_json
from dflashkit.train.grouped_topk import TOPK_GROUP, grouped_topk_reference, topk_kernel_runs
from dflashkit.train.loss import logit_statistics


def check(x: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Stop unless ``values`` are torch.topk's (``ref``) and ``ids`` point at them."""
    if not (torch.equal(values, ref) and torch.equal(x.gather(1, ids), values)):
        raise SystemExit(f"{what}: the values differ from torch.topk's or the ids do not point at them")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="logit rows of one loss chunk (the trainer's 2048)")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary; Qwen3's is 151936")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4], help="the kernel's num_warps to try")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(args.rows, args.vocab, device=dev).to(torch.bfloat16)
    ref = torch.topk(x, args.k, dim=-1).values

    def ms(fn) -> float:
        return 1e3 * statistics.median(seconds_per_call(fn, 50, 3, dev) for _ in range(5))

    def kernel_runs(g: int) -> bool:
        return dev == "cuda" and topk_kernel_runs(x, args.k, g)

    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=args.rows, vocab=args.vocab,
               k=args.k, default_group=TOPK_GROUP, torch_topk_ms=ms(lambda: torch.topk(x, args.k, dim=-1)))
    if not kernel_runs(TOPK_GROUP):
        out["kernel"] = "not timed: needs a CUDA device and a vocabulary of whole groups"
    for g in args.groups:
        check(x, *grouped_topk_reference(x, args.k, g), ref, f"group {g}")
        out[f"grouped_{g}_ms"] = ms(lambda g=g: grouped_topk_reference(x, args.k, g))
        if kernel_runs(g):
            from dflashkit.train.grouped_topk_triton import grouped_topk_triton

            check(x, *grouped_topk_triton(x, args.k, g), ref, f"the kernel at group {g}")
            out[f"kernel_{g}_ms"] = ms(lambda g=g: grouped_topk_triton(x, args.k, g))
    time_loss_pass(x, args, out, ms, kernel_runs(TOPK_GROUP))
    print(out)
    write_json(args.out, out)


def time_loss_pass(x: torch.Tensor, args, out: dict, ms, kernel: bool) -> None:
    """The loss pass's candidate step at the default group (module docstring) into ``out``."""
    rows, vocab = x.shape
    labels = torch.randint(0, vocab, (rows,), device=x.device)
    row_stats, grouped_stats = logit_statistics(False, True), logit_statistics(True, True)
    gmax = grouped_stats(x, labels, torch.float32, TOPK_GROUP)[3]
    out["given_max_torch_ms"] = ms(lambda: grouped_topk_reference(x, args.k, group_max=gmax))
    if kernel:
        from dflashkit.train.grouped_topk_triton import grouped_topk_triton

        check(x, *grouped_topk_triton(x, args.k, TOPK_GROUP, gmax), torch.topk(x, args.k, dim=-1).values,
              "the kernel from given maxima")
        out["given_max_kernel_ms"] = ms(lambda: grouped_topk_triton(x, args.k, TOPK_GROUP, gmax))
        for w in args.warps:
            out[f"given_max_kernel_w{w}_ms"] = ms(lambda w=w: grouped_topk_triton(x, args.k, TOPK_GROUP, gmax,
                                                                                  num_warps=w))

    def row_path():
        return row_stats(x, labels, torch.float32), grouped_topk_reference(x, args.k)

    def grouped_path():
        lse, tgt, arg, gmax = grouped_stats(x, labels, torch.float32, TOPK_GROUP)
        return (lse, tgt, arg), grouped_topk_reference(x, args.k, group_max=gmax)

    def kernel_path():
        from dflashkit.train.grouped_topk_triton import grouped_topk_triton

        lse, tgt, arg, gmax = grouped_stats(x, labels, torch.float32, TOPK_GROUP)
        return (lse, tgt, arg), grouped_topk_triton(x, args.k, TOPK_GROUP, gmax)

    paths = dict(row_stats_then_topk=row_path, grouped_stats_then_topk=grouped_path)
    if kernel:
        paths["grouped_stats_then_kernel"] = kernel_path
    (a_stats, a_top), *others = (path() for path in paths.values())
    for b_stats, b_top in others:
        torch.testing.assert_close(b_stats[0], a_stats[0], rtol=1e-5, atol=1e-5)
        if not (torch.equal(a_stats[2], b_stats[2]) and torch.equal(a_top[0], b_top[0])):
            raise SystemExit("the grouped statistics' argmax or candidates differ from the row path's")
    for name, path in paths.items():
        out[f"{name}_ms"] = ms(path)
    out["row_stats_ms"] = ms(lambda: row_stats(x, labels, torch.float32))
    out["grouped_stats_ms"] = ms(lambda: grouped_stats(x, labels, torch.float32, TOPK_GROUP))


if __name__ == "__main__":
    main()
