"""`dflashkit eval`: measure how many drafted tokens a target accepts, live, and write a report.

CPU (tiny or testbed target, fp32):
    dflashkit eval --target testbed:smollm2 --drafter out/drafter --dataset builtin:mtbench --num-prompts 8 \\
        --max-new-tokens 64 --out runs/eval-chain
One GPU (bf16, Triton tree attention):
    dflashkit eval --target /models/Qwen3-8B --drafter out/drafter --dataset builtin:mtbench builtin:humaneval \\
        --mode tree --tree-budget 64 --out runs/eval-tree
Several reports side by side:
    dflashkit eval --compare runs/eval-chain runs/eval-tree --out runs/compare
A running vLLM / SGLang server (concurrency sweep, tau from its metrics):
    dflashkit eval --server http://localhost:8000 --dataset builtin:mtbench --concurrency 1 4 16 --out runs/serve
(The speculative engine is batch 1; multi-GPU targets load with --device-map auto.)
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from dflashkit.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflashkit eval", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    what = p.add_argument_group("what to evaluate")
    what.add_argument("--target", help="HF model dir, .gguf file, or testbed:smollm2")
    what.add_argument("--drafter", help="drafter export directory (dflashkit export / reference format)")
    what.add_argument("--dataset", nargs="+", default=["builtin:mtbench"],
                      help="builtin:mtbench, builtin:humaneval, builtin:sharegpt or FILE.jsonl (several allowed)")
    what.add_argument("--num-prompts", type=int, default=20, help="prompts per dataset")
    what.add_argument("--baseline-prompts", type=int, default=None,
                      help="run the autoregressive baseline (speedup, lossless check) on the first N prompts of "
                           "each dataset only (default: all); tau always covers every prompt")
    what.add_argument("--max-prompt-tokens", type=int, default=None, help="keep only the last N prompt tokens")
    what.add_argument("--out", help="report directory (report.json, report.md, PNG plots)")
    decode = p.add_argument_group("decoding")
    decode.add_argument("--mode", choices=["chain", "tree"], default="chain")
    decode.add_argument("--tree-budget", type=int, default=64, help="tree mode: nodes per round incl. the root")
    decode.add_argument("--tree-top-k", type=int, default=8, help="tree mode: candidates per draft position")
    decode.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0: speculative sampling")
    decode.add_argument("--max-new-tokens", type=int, default=256)
    decode.add_argument("--block-size", type=int, default=None, help="default: the drafter's block_size")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--no-stop", action="store_true", help="ignore end-of-sequence tokens")
    run = p.add_argument_group("hardware")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    run.add_argument("--device-map", default=None, help="spread the target over GPUs (e.g. auto)")
    run.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="default: bfloat16 on CUDA, float32 on CPU")
    run.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                     help="tree attention: Triton kernel on CUDA (auto) or the PyTorch twin")
    other = p.add_argument_group("other modes")
    other.add_argument("--compare", nargs="+", metavar="REPORT_DIR", help="put several reports side by side")
    other.add_argument("--server", help="OpenAI-compatible server URL to sweep (vLLM, SGLang)")
    other.add_argument("--model", default=None, help="--server: model name (default: the server's first)")
    other.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    other.add_argument("--timeout", type=float, default=300.0, help="--server: seconds per request")
    return p


def _versions(device) -> dict:
    import torch
    import transformers

    import dflashkit

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "dflashkit": dflashkit.__version__,
           "device": str(device), "platform": platform.platform()}
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def _drafter_identity(path: str, drafter) -> dict:
    import hashlib
    from pathlib import Path

    weights = Path(path) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
    return {"path": str(Path(path).resolve()), "weights_sha256": digest, "block_size": drafter.block_size,
            "target_layer_ids": list(drafter.target_layer_ids), "mask_token_id": drafter.mask_token_id,
            "num_hidden_layers": drafter.config.num_hidden_layers}


def check_pair(target, drafter, drafter_path: str) -> None:
    """The drafter must read this target: same hidden size and vocabulary, tapped layers that exist."""
    problems = []
    if drafter.config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.config.hidden_size} != target's {target.hidden_size}")
    if drafter.config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.config.vocab_size} != target's {target.vocab_size}")
    if max(drafter.target_layer_ids) >= target.num_layers:
        problems.append(f"target_layer_ids {drafter.target_layer_ids} exceed the target's {target.num_layers} layers")
    if problems:
        raise UserError(f"{drafter_path}/config.json does not fit target {target.path}: " + "; ".join(problems)
                         + ". Train or export the drafter for this target.")


def _stop_ids(target) -> tuple[int, ...]:
    ids = set()
    for source in (getattr(target.model, "generation_config", None), target.tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    return tuple(sorted(int(i) for i in ids))


def run_eval(args) -> dict:
    import torch
    from tqdm import tqdm

    from dflashkit.drafter import load_drafter
    from dflashkit.target.loading import load_target

    from .engine import DecodeConfig, SpeculativeDecoder
    from .prompts import load_prompts
    from .report import summarize, write_report

    if not (args.target and args.drafter and args.out):
        raise UserError("dflashkit eval needs --target, --drafter and --out (or --compare / --server)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    target = load_target(args.target, dtype=dtype, device=device, device_map=args.device_map)
    device = next(target.model.parameters()).device
    drafter = load_drafter(args.drafter, dtype=dtype, device=device)
    check_pair(target, drafter, args.drafter)
    prompts = {spec: load_prompts(spec, target.tokenizer, args.num_prompts, args.max_prompt_tokens)
               for spec in args.dataset}
    config = DecodeConfig(mode=args.mode, block_size=args.block_size, tree_budget=args.tree_budget,
                          tree_top_k=args.tree_top_k, temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, seed=args.seed,
                          stop_token_ids=() if args.no_stop else _stop_ids(target),
                          attention_backend=args.attention_backend)
    longest = max(len(p.input_ids) for ps in prompts.values() for p in ps)
    decoder = SpeculativeDecoder(target, drafter, config,
                                 max_len=longest + args.max_new_tokens + max(args.tree_budget, 64) + 1)
    first = next(iter(prompts.values()))[0].input_ids
    decoder.generate(first), decoder.generate_autoregressive(first)  # warm-up: kernels, allocator
    results = {spec: ([], []) for spec in prompts}
    total = sum(len(ps) for ps in prompts.values())
    with tqdm(total=total, desc=f"eval {args.mode}", unit="prompt") as bar:
        for spec, ps in prompts.items():
            for k, prompt in enumerate(ps):
                results[spec][0].append(decoder.generate(prompt.input_ids))
                if args.baseline_prompts is None or k < args.baseline_prompts:
                    results[spec][1].append(decoder.generate_autoregressive(prompt.input_ids))
                tau = sum(n for r in results[spec][0] for n in r.acceptance_lengths) / max(
                    sum(len(r.acceptance_lengths) for r in results[spec][0]), 1)
                bar.set_postfix(dataset=spec, tau=f"{tau:.2f}")
                bar.update()
    decoder.close()
    greedy = args.temperature == 0
    block = decoder.block_size
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: v for k, v in vars(args).items() if k not in ("compare", "server")},
        "block_size": block,
        "versions": _versions(device),
        "target": {**target.identity(), "family": target.family, "num_layers": target.num_layers},
        "drafter": _drafter_identity(args.drafter, drafter),
        "datasets": {spec: summarize(spec_r, ar_r, block, greedy) for spec, (spec_r, ar_r) in results.items()},
        "overall": summarize([r for s, _ in results.values() for r in s], [r for _, a in results.values() for r in a],
                             block, greedy, paired=[r for s, a in results.values() for r in s[:len(a)]]),
    }
    write_report(report, args.out)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        from .report import compare_reports

        print(compare_reports(args.compare, args.out))
        return 0
    if args.server:
        from .serving import run_sweep

        run_sweep(args)
        return 0
    if args.baseline_prompts is not None and args.baseline_prompts < 0:
        raise UserError(f"--baseline-prompts must be 0 or more, got {args.baseline_prompts}")
    report = run_eval(args)
    overall = report["overall"]
    speed = (f"speedup {overall['speedup']:.2f}x; verify/AR step {overall['verify_over_ar_step']:.2f}"
             if "speedup" in overall else "no autoregressive baseline (--baseline-prompts 0)")
    print(f"tau {overall['tau']:.3f} over {overall['rounds']} rounds; {speed}; report in {args.out}")
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit eval", main))
