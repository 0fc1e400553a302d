"""Compare the training objectives (ce, dpace, kl) on the same shards with the same steps and seed.

    python -m lab.compare_losses --shards runs/x/shards --target testbed:smollm2 --out runs/loss-compare \
        --recipe recipes/smollm2-135m-cpu.yaml --seeds 0,1,2 epochs=3 num_anchors=24    # CPU, about an hour
    python -m lab.compare_losses --shards runs/x/shards --target /root/testbed/smollm2-bf16 \
        --out runs/loss-compare --recipe recipes/smollm2-135m.yaml --device cuda --eval-prompts 80

The shards need ``last_hidden`` (``dflashkit extract --store-last-hidden``) for ``kl``. For each objective and
each ``--seeds`` value it trains a drafter (the recipe, then the given key=value overrides, then the settings of
the comparison; only ``loss`` differs within a seed, and the seed sets init, held-out split, data order and
anchors), reads the held-out τ_sim of the run's summary, then measures live τ as ``dflashkit eval`` does (chain,
no AR baseline) on ``--eval-data`` (default MT-bench). Prints a markdown table (mean and spread over seeds, and
each objective's wins over ce seed by seed) and writes ``compare.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dflashkit.demo import evaluate, train


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
    ap.add_argument("--eval-data", nargs="+", default=["builtin:mtbench"])
    ap.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[0],
                    help="comma-separated seeds, e.g. 0,1,2 (a list, so that key=value overrides may follow)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    out = Path(args.out)
    runs = []
    for seed in args.seeds:
        for loss in args.losses:
            run = out / f"{loss}-seed{seed}"
            if not (run / "eval-chain" / "report.json").is_file():  # finished runs are kept: rerun resumes
                train_and_eval(args, loss, seed, run)
            summary = json.loads((run / "train" / "summary.json").read_text())
            report = json.loads((run / "eval-chain" / "report.json").read_text())
            runs.append({"loss": loss, "seed": seed, "tau_sim": summary.get("eval/tau_sim"),
                         "eval_ce": summary.get("eval/ce"), "eval_acc": summary.get("eval/acc"),
                         "steps": summary.get("step"), "tau_live_chain": report["overall"]["tau"],
                         "rounds": report["overall"]["rounds"]})
    (out / "compare.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2) + "\n")
    print(table(runs, args.losses))


def train_and_eval(args, loss: str, seed: int, run: Path) -> None:
    fields = dict(shards=args.shards, output_dir=str(run / "train"), loss=loss, export_dir=str(run / "drafter"),
                  target=args.target, wandb=False, seed=seed)
    if args.device == "cpu":
        fields["mixed_precision"] = "no"
    train(args.recipe, args.overrides, **fields)
    evaluate(target=args.target, drafter=str(run / "drafter"), dataset=list(args.eval_data),
             num_prompts=args.eval_prompts, max_new_tokens=args.eval_new_tokens, device=args.device, mode="chain",
             baseline_prompts=0, out=str(run / "eval-chain"))


def table(runs: list[dict], losses: list[str]) -> str:
    """Mean (min–max) over seeds per objective, and in how many seeds it beat ce on each acceptance measure."""
    def spread(values):
        return f"{statistics.mean(values):.3f} ({min(values):.3f}–{max(values):.3f})"

    by = {(r["loss"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    lines = ["| loss | seeds | steps | held-out CE | held-out acc | τ_sim | live τ (chain) | beats ce: τ_sim, live τ |",
             "|---|---|---|---|---|---|---|---|"]
    for loss in losses:
        rs = [by[(loss, s)] for s in seeds if (loss, s) in by]
        if not rs:
            continue
        wins = "—"
        if loss != "ce" and all(("ce", s) in by for s in seeds):
            w_sim = sum(by[(loss, s)]["tau_sim"] > by[("ce", s)]["tau_sim"] for s in seeds)
            w_live = sum(by[(loss, s)]["tau_live_chain"] > by[("ce", s)]["tau_live_chain"] for s in seeds)
            wins = f"{w_sim}/{len(seeds)}, {w_live}/{len(seeds)}"
        lines.append(f"| {loss} | {len(rs)} | {rs[0]['steps']} | {spread([r['eval_ce'] for r in rs])} "
                     f"| {spread([r['eval_acc'] for r in rs])} | {spread([r['tau_sim'] for r in rs])} "
                     f"| {spread([r['tau_live_chain'] for r in rs])} | {wins} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
