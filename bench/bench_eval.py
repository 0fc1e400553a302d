"""Live speculative decoding, chain and tree, in one process: tau, speedup beside the cost model, step times,
the lossless check and the wall time of the whole run (CUDA graphs by default).

One H200, the testbed and a drafter export:
    python -m bench.bench_eval --target /root/testbed/smollm2-bf16 --drafter out/drafter \\
        --dataset builtin:mtbench builtin:humaneval --num-prompts 164 --max-new-tokens 256 \\
        --reference-prompts 8 --out runs/bench/bench_eval.json
CPU toy (a tiny random target with the testbed's tokenizer and a random drafter, fp32, eager):
    python -m bench.bench_eval --toy --out /tmp/bench_eval_toy.json

Each mode is one `run_eval` over all datasets (its report directory next to --out; --num-prompts 164 takes all
80 MT-bench and 164 HumanEval prompts); the AR baseline and the HF reference run once per prompt and serve both
modes. The table shows per mode and dataset: tau, measured speedup (wall time, and per new token), the cost model
tau / (verify/AR + draft/AR) over the same baseline prompts and the ratio per token / model, the AR / verify /
draft step times, lossless mismatches and ties; then where each mode's wall time went (report["timing"]: load,
prepare = captures and warm-up, reference = the batched HF generate, speculative, baseline, report) and the total.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def toy_pair(root: Path) -> tuple[str, str]:
    """A tiny random Llama saved with the testbed's tokenizer, and a random drafter export for it."""
    import torch
    import transformers as tf

    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
    from dflashkit.targets.loading import resolve_target_dir

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                            tie_word_embeddings=True)
    tf.LlamaForCausalLM(config).save_pretrained(root / "target")
    tf.AutoTokenizer.from_pretrained(resolve_target_dir("testbed:smollm2")[0]).save_pretrained(root / "target")
    save_drafter(build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=8, mask_token_id=0)),
                 root / "drafter")
    return str(root / "target"), str(root / "drafter")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--toy", action="store_true", help="tiny random pair on the CPU (overrides the sizes)")
    parser.add_argument("--dataset", nargs="+", default=["builtin:mtbench", "builtin:humaneval"])
    parser.add_argument("--num-prompts", type=int, default=164, help="per dataset (at most)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    parser.add_argument("--tree-budget", type=int, default=32)
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--baseline-prompts", type=int, default=None, help="AR baseline prompts per dataset")
    parser.add_argument("--reference-prompts", type=int, default=8, help="HF generate reference prompts per dataset")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", default="runs/bench/bench_eval.json")
    args = parser.parse_args(argv)

    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.run import run_eval

    work = Path(tempfile.mkdtemp(prefix="bench_eval_")) if args.toy else None
    if args.toy:
        args.target, args.drafter = toy_pair(work)
        args.num_prompts, args.max_new_tokens, args.tree_budget = 2, 16, 8
    if not (args.target and args.drafter):
        parser.error("give --target and --drafter, or --toy")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, started, shared = [], time.perf_counter(), {}
    for mode in args.modes:
        mode_start = time.perf_counter()
        opts = EvalOptions(target=args.target, drafter=args.drafter, out=out.with_suffix("") / mode,
                           dataset=args.dataset, mode=mode, tree_budget=args.tree_budget, tree_top_k=args.tree_top_k,
                           max_new_tokens=args.max_new_tokens, no_cuda_graphs=args.no_cuda_graphs,
                           num_prompts=args.num_prompts, baseline_prompts=args.baseline_prompts,
                           reference_prompts=args.reference_prompts, dtype=args.dtype)
        report = run_eval(opts, shared_baseline=shared)
        for name, o in [*report["datasets"].items(), ("all", report["overall"])]:
            lossless = o.get("lossless", {})
            rows.append({"mode": mode, "dataset": name, "prompts": o["prompts"], "tau": o["tau"],
                         "speedup": o.get("speedup"), "speedup_per_token": o.get("speedup_per_token"),
                         "cost_model_speedup": o.get("cost_model_speedup"),
                         "speedup_over_cost_model": o.get("speedup_over_cost_model"), "ar_step_ms": o.get("ar_step_ms"),
                         "verify_ms_per_round": o["verify_ms_per_round"], "draft_ms_per_round": o["draft_ms_per_round"],
                         "mismatches": lossless.get("mismatches"), "ties": lossless.get("ties"),
                         "device": report["versions"]["device"], "gpu": report["versions"].get("gpu")})
        rows[-1]["mode_wall_s"] = time.perf_counter() - mode_start
        rows[-1]["timing_s"] = report["timing"]
        if "partial" in report or "stop_request" in report:  # a stop request ends the bench, not only this mode
            print(f"stopped during mode {mode}: the remaining modes were not run", file=sys.stderr)
            break
    total = time.perf_counter() - started
    header = ["mode", "dataset", "prompts", "tau", "speedup", "per token", "cost model", "per token/model", "AR ms",
              "verify ms", "draft ms", "mismatch", "ties"]
    keys = ["mode", "dataset", "prompts", "tau", "speedup", "speedup_per_token", "cost_model_speedup",
            "speedup_over_cost_model",
            "ar_step_ms", "verify_ms_per_round", "draft_ms_per_round", "mismatches", "ties"]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    for row in rows:
        if "timing_s" in row:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["timing_s"].items())
            print(f"{row['mode']}: {row['mode_wall_s']:.1f} s ({parts})")
    print(f"total wall time {total:.1f} s (goal on the H200: <= 300 s for MT-bench 80 + HumanEval 164, chain + tree)")
    out.write_text(json.dumps({"rows": rows, "total_wall_s": total, "args": vars(args)}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
