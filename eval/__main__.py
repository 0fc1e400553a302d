"""`dflashkit eval`: measure how many drafted tokens a target accepts, live, and write a report.

CPU (tiny or testbed target, fp32):
    dflashkit eval --target testbed:smollm2 --drafter out/drafter --dataset builtin:mtbench --num-prompts 8 \\
        --max-new-tokens 64 --out runs/eval-chain
One GPU (bf16, Triton tree attention):
    dflashkit eval --target /models/Qwen3-8B --drafter out/drafter --dataset builtin:mtbench builtin:humaneval \\
        --mode tree --tree-budget 64 --out runs/eval-tree
Several reports side by side:
    dflashkit eval --compare runs/eval-chain runs/eval-tree --out runs/compare
Served by vLLM in-process (pip install 'dflashkit[vllm]'; one GPU): tau from vLLM's counters, lossless
agreement with and without the drafter, tok/s / TTFT / ITL per concurrency, prefix cache on and off, a verdict;
with several --num-speculative-tokens the per-batch-size schedule (schedule.json) served and measured too:
    dflashkit eval --engine vllm --target /models/Qwen3-8B --drafter out/drafter --dataset builtin:mtbench \
        --num-prompts 80 --concurrency 1 4 16 64 128 --num-speculative-tokens 1 3 7 15 --baseline ngram mtp \
        --prefix-caching on --out runs/eval-vllm
A running vLLM / SGLang server (concurrency sweep, tau from its metrics):
    dflashkit eval --server http://localhost:8000 --dataset builtin:mtbench --concurrency 1 4 16 --out runs/serve
Several running servers (none = without speculation, kN = the drafter at N tokens): speedups and the schedule:
    dflashkit eval --server none=http://h:8000 k3=http://h:8001 k15=http://h:8002 --repeats 3 --out runs/plan
Servers started from an --engine vllm report's serve commands (report.json, schedule.json), beside its engines:
    dflashkit eval --server none=http://h:8000 schedule=http://h:8001 --engine-report runs/eval-vllm --out runs/served
(The speculative engine is batch 1; multi-GPU targets load with --device-map auto.)
On one GPU the target's decode steps and the drafter's pass replay CUDA graphs (--no-cuda-graphs: eager).
Greedy runs check losslessness against HF generate on the baseline prompts (--reference-prompts N: fewer).
Ctrl-C, SIGTERM or --time-limit S: the current prompt finishes, the report of the prompts done is written,
marked partial, and the command exits 1.
One run per --out: a second eval into the same report directory stops at once naming the first (its lock file
.dflashkit.lock holds the pid and host). --out must be new or empty: a directory holding an earlier report or
files of yours is refused before the target loads (--overwrite writes the report there anyway, replacing only
eval's own files of the same names).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager

from dflashkit.errors import UserError

# eval's numeric flags: dest -> (lowest allowed, whether the lowest itself is allowed, highest allowed or None,
# what the number is); each is checked before anything loads
FLAG_RANGES = {
    "num_prompts": (1, True, None, "prompts per dataset"),
    "baseline_prompts": (0, True, None, "0: no autoregressive baseline"),
    "reference_prompts": (0, True, None, "0: no lossless check"),
    "max_prompt_tokens": (1, True, None, "prompt tokens kept"),
    "time_limit": (0, True, None, "seconds; 0 stops after the first prompt, no flag: no limit"),
    "tree_budget": (2, True, None, "nodes per round: the root and at least one draft"),
    "tree_top_k": (1, True, None, "candidates per draft position"),
    "temperature": (0, True, None, "0: greedy"),
    "top_p": (0, False, 1, "1: off"),
    "top_k": (0, True, None, "0: off"),
    "max_new_tokens": (1, True, None, "new tokens per prompt"),
    "block_size": (2, True, None, "the anchor and at least one draft"),
    "concurrency": (1, True, None, "requests in flight"),
    "num_speculative_tokens": (1, True, None, "drafts per step"),
    "repeats": (1, True, None, "runs per engine and level"),
    "max_requests_per_level": (1, True, None, "prompts a level takes"),
    "min_waves": (1, True, None, "waves of c requests per level"),
    "gpu_memory_utilization": (0, False, 1, "share of the GPU"),
    "max_model_len": (1, True, None, "tokens"),
    "timeout": (0, False, None, "seconds per request"),
}
# flags that one engine does not read (dest -> who reads it): given to the other, they are refused, not ignored
ENGINE_ONLY = {
    "dflashkit": {"concurrency": "--server and --engine vllm", "num_speculative_tokens": "--engine vllm",
                  "max_model_len": "--engine vllm", "repeats": "--server and --engine vllm",
                  "baseline": "--engine vllm", "max_requests_per_level": "--server and --engine vllm",
                  "min_waves": "--server and --engine vllm", "cudagraph_capture_size": "--engine vllm",
                  "per_prompt": "--engine vllm"},
    "vllm": {"block_size": "the dflashkit engine (with vLLM: --num-speculative-tokens)",
             "time_limit": "the dflashkit engine", "baseline_prompts": "the dflashkit engine",
             "reference_prompts": "the dflashkit engine", "confidence_threshold": "the dflashkit engine"},
}


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
    what.add_argument("--reference-prompts", type=int, default=None,
                      help="lossless check against HF generate on the first N baseline prompts of each dataset "
                           "(default: all of them; the reference is slow)")
    what.add_argument("--max-prompt-tokens", type=int, default=None, help="keep only the last N prompt tokens")
    what.add_argument("--out", help="report directory (report.json, report.md, PNG plots); new or empty")
    what.add_argument("--overwrite", action="store_true",
                      help="write into an --out that holds files (an earlier report, files of yours): eval's files "
                           "of the same names are replaced, nothing else is touched")
    what.add_argument("--chat-template", default=None, metavar="FILE",
                      help="Jinja file replacing the target tokenizer's chat template (as extraction and training; "
                           "default: the template the drafter was trained with, recorded in its config.json)")
    what.add_argument("--chat-template-kwargs", default=None,
                      help='JSON of extra chat template variables (as extraction and training), '
                           'e.g. \'{"enable_thinking": false}\' (default: those the drafter was trained with)')
    what.add_argument("--time-limit", type=float, default=None, metavar="S",
                      help="stop after the prompt running when S seconds have passed; write a partial report")
    what.add_argument("--engine", choices=["dflashkit", "vllm"], default="dflashkit",
                      help="dflashkit: its own live decoder (chain / tree); vllm: the pair inside vllm.LLM")
    decode = p.add_argument_group("decoding")
    decode.add_argument("--mode", choices=["chain", "tree"], default="chain")
    decode.add_argument("--tree-budget", type=int, default=64, help="tree mode: nodes per round incl. the root")
    decode.add_argument("--tree-top-k", type=int, default=8, help="tree mode: candidates per draft position")
    decode.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0: speculative sampling")
    decode.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1 = off)")
    decode.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = off)")
    decode.add_argument("--max-new-tokens", type=int, default=256)
    decode.add_argument("--block-size", type=int, default=None, help="default: the drafter's block_size")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--confidence-threshold", type=float, default=None, metavar="T",
                        help="chain, DSpark drafters: verify each round's drafts up to the first whose confidence is "
                             "below T, and report tau and tokens verified per round with and without the cut "
                             "(0 = off)")
    decode.add_argument("--no-stop", action="store_true", help="ignore end-of-sequence tokens")
    run = p.add_argument_group("hardware")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    run.add_argument("--device-map", default=None, help="spread the target over GPUs (e.g. auto)")
    run.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="default: bfloat16 on CUDA, float32 on CPU")
    run.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                     help="tree attention: Triton kernel on CUDA (auto) or the PyTorch twin")
    run.add_argument("--no-cuda-graphs", action="store_true",
                     help="run the target's decode steps eagerly instead of replaying CUDA graphs (CUDA only)")
    other = p.add_argument_group("other modes")
    other.add_argument("--compare", nargs="+", metavar="REPORT_DIR", help="put several reports side by side")
    other.add_argument("--server", nargs="+", help="OpenAI-compatible server URL to sweep (vLLM, SGLang); or "
                       "NAME=URL pairs (none=, kN=, baselines, schedule=) for the serving plan and its schedule")
    other.add_argument("--engine-report", default=None, metavar="REPORT_DIR",
                       help="--server NAME=URL: the `eval --engine vllm` report whose serve commands started the "
                            "servers: what each serves is checked against the engine of its name, cells side by side")
    other.add_argument("--model", default=None, help="--server: model name (default: the server's first)")
    other.add_argument("--concurrency", type=int, nargs="+", default=None,
                       help="requests in flight per level (default --server: 1 2 4 8 16 32; --engine vllm: 1 4 16 64)")
    add_vllm_flags(p)
    other.add_argument("--timeout", type=float, default=300.0, help="--server: seconds per request")
    return p


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The flags only `--engine vllm` reads."""
    served = p.add_argument_group("--engine vllm")
    served.add_argument("--num-speculative-tokens", type=int, nargs="+", default=None,
                        help="one engine per value; default block_size - 1 (vLLM reads no block_size). Several "
                             "values give the per-batch-size schedule (a causal-in-block drafter serves every k "
                             "as trained; a non-causal one warns: its acceptance changes)")
    served.add_argument("--repeats", type=int, default=None, help="runs per engine and level (default 3): the "
                        "median is reported with the runs' spread")
    served.add_argument("--max-requests-per-level", type=int, default=None,
                        help="prompts a level takes, cycled to fill its waves (default: every prompt)")
    served.add_argument("--min-waves", type=int, default=None,
                        help="a level sends at least this many waves of c requests (default 1; 4 gives runs of "
                             "seconds where one wave of many requests takes half a second)")
    served.add_argument("--cudagraph-capture-size", default=None, metavar="auto|vllm|N",
                        help="vLLM's max_cudagraph_capture_size per engine: auto (default) covers a decode step of "
                             "the largest level at the engine's k (vLLM's default stops at 512 tokens and runs "
                             "larger steps eagerly); vllm: its default; N: that many tokens")
    served.add_argument("--baseline", nargs="+", choices=["ngram", "mtp", "v1"], default=None,
                        help="also serve what a user would deploy instead: vLLM's n-gram lookup, the target's MTP "
                             "head; v1: no speculation on vLLM's V1 model runner (what a schedule runs on)")
    served.add_argument("--no-schedule-run", action="store_true",
                        help="derive the schedule without serving it in one more engine")
    served.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=["on", "off"],
                        help="vLLM's prefix cache for the multi-turn prompts (the first also serves the main run)")
    served.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="per vLLM engine")
    served.add_argument("--max-model-len", type=int, default=None,
                        help="default: the longest prompt (multi-turn included) + new tokens + one block")
    served.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    served.add_argument("--per-prompt", action="store_const", const=True, default=None,
                        help="also send every prompt alone to the drafter's engine (the headline k): each one's "
                             "τ from vLLM's counters and its answer, in outputs.jsonl; `--compare` pairs them with "
                             "a `dflashkit eval` report of the same prompts")


def _fail(message: str, status: int = 1) -> int:
    """A run that ended but did not finish (exit 1); user errors raise UserError for dflashkit.cli.run_main."""
    print(f"dflashkit eval: {message}", file=sys.stderr)
    return status


def _range_text(low, inclusive: bool, high) -> str:
    if high is not None:
        return f"in {'[' if inclusive else '('}{low}, {high}]"
    return f"{'>=' if inclusive else '>'} {low}"


def check_numeric_flags(args) -> None:
    """Every numeric flag in its range (``FLAG_RANGES``); one line naming the first flag that is not."""
    for dest, (low, inclusive, high, meaning) in FLAG_RANGES.items():
        given = getattr(args, dest)
        for value in given if isinstance(given, list) else [given]:
            if value is None:
                continue
            above = value >= low if inclusive else value > low
            if not (math.isfinite(value) and above and (high is None or value <= high)):
                raise UserError(f"--{dest.replace('_', '-')} must be {_range_text(low, inclusive, high)} "
                                f"({meaning}), got {value}")


def check_engine_flags(args) -> None:
    """A flag the chosen engine does not read is refused: it would be ignored without a word."""
    for dest, reader in ENGINE_ONLY[args.engine].items():
        if getattr(args, dest) is not None:
            raise UserError(f"--{dest.replace('_', '-')} is read by {reader}, not by --engine {args.engine}: "
                            "drop it, or pick the engine that reads it")


def check_block_size_flag(args) -> None:
    """--block-size may shorten the drafter's blocks, never lengthen them: it drafts only the positions it was
    trained on. Reads the drafter's config.json only, before the target loads."""
    from dflashkit.drafter import read_drafter_config

    trained = read_drafter_config(args.drafter).block_size
    if args.block_size is not None and args.block_size > trained:
        raise UserError(f"--block-size {args.block_size} is larger than the drafter's block_size {trained} "
                        f"({args.drafter}/config.json): it was trained to draft {trained - 1} tokens per block; use "
                        f"--block-size {trained} or less, or leave it out")


@contextmanager
def report_dir(out: str | None, overwrite: bool):
    """The lock on --out (one eval per report directory), then the check that --out may take a report: new or
    empty, or --overwrite (eval/report.py report_dir_problem). Nothing when there is no --out."""
    if out is None:
        yield
        return
    import os

    from dflashkit.files import disk_full_is_user_error
    from dflashkit.outputs import OutputLock, check_output_dir

    from .report import report_dir_problem

    made = not os.path.lexists(out)
    try:
        with OutputLock(out, "eval"):
            check_output_dir(out, what="a new report directory", problem=report_dir_problem, overwrite=overwrite,
                             forcing="write the report into it anyway (eval's files of the same names are "
                                     "replaced, nothing else)")
            with disk_full_is_user_error(out, then="run the same command again with --overwrite"):
                yield
    finally:
        if made:  # a run that stopped before writing anything leaves no empty directory behind
            try:
                os.rmdir(out)
            except OSError:  # not empty (the report), or already gone
                pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_numeric_flags(args)
    from dflashkit.outputs import check_apart

    check_apart({"--out": args.out}, {"--drafter": args.drafter, "--target": args.target, "--dataset": args.dataset,
                                      "--compare": args.compare})
    if args.compare:
        from .report import compare_reports, read_outputs, read_report

        for path in args.compare:  # every report (and its outputs.jsonl) readable before --out is touched
            read_report(path)
            read_outputs(path)
        with report_dir(args.out, args.overwrite):
            print(compare_reports(args.compare, args.out))
        return 0
    if args.server:
        from .serving import run_sweep

        with report_dir(args.out, args.overwrite):
            run_sweep(args.server, args.dataset, args.num_prompts, args.concurrency or [1, 2, 4, 8, 16, 32],
                      args.max_new_tokens, args.temperature, args.model, args.timeout, args.out, args.repeats or 1,
                      args.max_requests_per_level, args.min_waves or 1, args.engine_report)
        return 0
    if args.engine_report:
        raise UserError("--engine-report is read by --server NAME=URL ...: drop it, or add the servers")
    if not (args.target and args.drafter and args.out):
        raise UserError("needs --target, --drafter and --out (or --compare / --server)")
    template_kwargs = _template_kwargs(args.chat_template_kwargs)
    check_engine_flags(args)
    if args.engine == "vllm":
        config = _vllm_config(args)
        with report_dir(args.out, args.overwrite):
            return _main_vllm(args, config, template_kwargs)
    from .decoder import DecodeConfig

    config = DecodeConfig(mode=args.mode, block_size=args.block_size, tree_budget=args.tree_budget,
                          tree_top_k=args.tree_top_k, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, max_new_tokens=args.max_new_tokens, seed=args.seed,
                          attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs,
                          confidence_threshold=args.confidence_threshold or 0.0)
    config.check()  # user errors propagate to dflashkit.cli.run_main: one line, exit 2
    with report_dir(args.out, args.overwrite):
        check_block_size_flag(args)  # reads the drafter's config.json: a bad one stops here, before the target
        report = _run_local(args, config, template_kwargs)
    return _summary(report, args.out)


def _template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs as a dict (None: not given, the drafter's own are used)."""
    if text is None:
        return None
    try:
        template_kwargs = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"--chat-template-kwargs {text!r} is not JSON ({error}); "
                        'write e.g. \'{"enable_thinking": false}\'') from None
    if not isinstance(template_kwargs, dict):
        raise UserError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return template_kwargs


def _run_local(args, config, template_kwargs: dict | None) -> dict:
    from .run import run_eval

    return run_eval(args.target, args.drafter, args.out, args.dataset, config, num_prompts=args.num_prompts,
                    baseline_prompts=args.baseline_prompts, max_prompt_tokens=args.max_prompt_tokens,
                    use_stop_tokens=not args.no_stop, device=args.device, device_map=args.device_map,
                    dtype=args.dtype, chat_template_kwargs=template_kwargs, time_limit_s=args.time_limit,
                    reference_prompts=args.reference_prompts, chat_template=args.chat_template)


def _summary(report: dict, out: str) -> int:
    """The run's numbers in one line; exit 1 when a stop request left the report partial."""
    overall = report["overall"]
    from .report import HARNESS_WORDS

    speed = (f"harness speedup {overall['speedup']:.2f}x ({overall['speedup_per_token']:.2f}x per token, cost "
             f"model {overall['cost_model_speedup']:.2f}x; {HARNESS_WORDS}); "
             f"verify/AR step {overall['verify_over_ar_step']:.2f}"
             if "speedup" in overall else "no autoregressive baseline (--baseline-prompts 0)")
    lossless = overall.get("lossless")
    check = f"; lossless: {lossless['mismatches']} mismatches, {lossless['ties']} ties" if lossless else ""
    print(f"tau {overall['tau']:.3f} over {overall['rounds']} rounds; {speed}{check}; report in {out}")
    if "partial" in report:
        partial = report["partial"]
        return _fail(f"stopped by {partial['reason']}: partial report of {partial['prompts_done']} of "
                     f"{partial['prompts_planned']} prompts in {out}")
    return 0


def _vllm_config(args):
    """The settings of `--engine vllm`, checked before --out is touched."""
    from .vllm_engine import VllmEvalConfig

    if args.mode != "chain" or args.temperature != 0:
        raise UserError("--engine vllm measures greedy chain drafting (vLLM's dflash): "
                        "drop --mode tree and --temperature")
    config = VllmEvalConfig(concurrency=args.concurrency or [1, 4, 16, 64],
                            num_speculative_tokens=args.num_speculative_tokens, prefix_caching=args.prefix_caching,
                            max_new_tokens=args.max_new_tokens, dtype=args.dtype or "bfloat16",
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                            enforce_eager=args.enforce_eager, seed=args.seed, use_stop_tokens=not args.no_stop,
                            repeats=args.repeats or 3, baselines=args.baseline or [],
                            max_requests_per_level=args.max_requests_per_level, min_waves=args.min_waves or 1,
                            cudagraph_capture=args.cudagraph_capture_size or "auto",
                            schedule_run=not args.no_schedule_run, per_prompt=bool(args.per_prompt))
    config.check()
    return config


def _main_vllm(args, config, template_kwargs: dict | None) -> int:
    from .vllm_engine import run_vllm_eval

    report = run_vllm_eval(args.target, args.drafter, args.out, args.dataset, config, args.num_prompts,
                           args.max_prompt_tokens, template_kwargs,
                           chat_template=args.chat_template)  # user errors: dflashkit.cli.run_main
    print(f"{report['verdict']['text']}\ntau {report['overall']['tau']:.3f} (vLLM, k "
          f"{report['num_speculative_tokens']}); lossless {report['lossless']['identical']}/"
          f"{report['lossless']['requests']} identical; report in {args.out}")
    print("\n".join(headline_console(report)))  # last: what a user reads and deploys
    return 0


def headline_console(report: dict) -> list[str]:
    """The console's last lines of `--engine vllm`: each engine's speedup per concurrency measured in vLLM, the
    plan in words and its serve command (report.json's ``headline``)."""
    head = report["headline"]
    lines = [f"speedup per concurrency ({head['measured_in']}):"]
    lines += [f"  {name}: " + ", ".join(f"{x:.2f}x at {c}" for c, x in levels.items())
              for name, levels in head["speedup"].items()]
    return lines + [f"Plan: {report['plan_verdict']['text']}", f"Serve command: {head['serve_command']}"]


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit eval", main))
