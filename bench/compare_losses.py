"""Compare the training objectives (ce, dpace, kl) on the same shards with the same steps and seed.

    python bench/compare_losses.py --shards runs/x/shards --target testbed:smollm2 --out runs/loss-compare \
        --recipe recipes/smollm2-135m-cpu.yaml epochs=4              # CPU, minutes
    python bench/compare_losses.py --shards runs/x/shards --target /root/testbed/smollm2-bf16 \
        --out runs/loss-compare --recipe recipes/smollm2-135m.yaml --device cuda --eval-prompts 80

The shards need ``last_hidden`` (``dflashkit extract --store-last-hidden``) for ``kl``. For each objective it
trains a drafter (the recipe plus the given key=value overrides, only ``loss`` differs), reads the held-out
τ_sim of the run's summary, then measures live τ with ``dflashkit eval`` (chain) on MT-bench. Prints a
markdown table and writes ``compare.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflashkit.cli import main as dflashkit


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--losses", nargs="+", default=["ce", "dpace", "kl"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eval-prompts", type=int, default=6)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = {}
    for loss in args.losses:
        run = out / loss
        rc = dflashkit(["train", "--recipe", args.recipe, "--shards", args.shards, "--output-dir", str(run / "train"),
                        "--loss", loss, f"export_dir={run / 'drafter'}", f"target={args.target}", "wandb=false",
                        *(["mixed_precision=no"] if args.device == "cpu" else []), *args.overrides])
        if rc:
            raise SystemExit(f"training with loss={loss} failed (exit {rc})")
        summary = json.loads((run / "train" / "summary.json").read_text())
        rc = dflashkit(["eval", "--target", args.target, "--drafter", str(run / "drafter"), "--dataset",
                        "builtin:mtbench", "--num-prompts", str(args.eval_prompts), "--max-new-tokens",
                        str(args.eval_new_tokens), "--device", args.device, "--mode", "chain",
                        "--out", str(run / "eval-chain")])
        if rc:
            raise SystemExit(f"eval of loss={loss} failed (exit {rc})")
        report = json.loads((run / "eval-chain" / "report.json").read_text())
        rows[loss] = {"tau_sim": summary.get("eval/tau_sim"), "eval_ce": summary.get("eval/ce"),
                      "eval_acc": summary.get("eval/acc"), "steps": summary.get("step"),
                      "tau_live_chain": report["overall"]["tau"]}
    (out / "compare.json").write_text(json.dumps({"args": vars(args), "results": rows}, indent=2) + "\n")
    print("| loss | steps | held-out CE | held-out acc | τ_sim | live τ (chain, MT-bench) |")
    print("|---|---|---|---|---|---|")
    for loss, r in rows.items():
        print(f"| {loss} | {r['steps']} | {r['eval_ce']:.3f} | {r['eval_acc']:.3f} | {r['tau_sim']:.3f} "
              f"| {r['tau_live_chain']:.3f} |")


if __name__ == "__main__":
    main()
