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
import sys
from contextlib import contextmanager

from dflashkit.errors import UserError
from dflashkit.options import build_parser as parser_of
from dflashkit.options import parse_options

from .options import EvalOptions, check_engine_flags, check_numeric_flags, decode_config


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, built from its options (eval/options.py ``EvalOptions``)."""
    return parser_of(EvalOptions, prog="dflashkit eval", description=__doc__.split("\n")[0], epilog=__doc__)


def parse_command_line(argv: list[str] | None = None) -> EvalOptions:
    """The command line as the options the library takes."""
    return parse_options(EvalOptions, argv, build_parser())


def _fail(message: str, status: int = 1) -> int:
    """A run that ended but did not finish (exit 1); user errors raise UserError for dflashkit.cli.run_main."""
    print(f"dflashkit eval: {message}", file=sys.stderr)
    return status


def check_block_size_flag(opts: EvalOptions) -> None:
    """--block-size may shorten the drafter's blocks, never lengthen them: it drafts only the positions it was
    trained on. Reads the drafter's config.json only, before the target loads."""
    from dflashkit.drafter import read_drafter_config

    trained = read_drafter_config(opts.drafter).block_size
    if opts.block_size is not None and opts.block_size > trained:
        raise UserError(f"--block-size {opts.block_size} is larger than the drafter's block_size {trained} "
                        f"({opts.drafter}/config.json): it was trained to draft {trained - 1} tokens per block; use "
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
    opts = parse_command_line(argv)
    check_numeric_flags(opts)
    from dflashkit.outputs import check_apart

    check_apart({"--out": opts.out}, {"--drafter": opts.drafter, "--target": opts.target, "--dataset": opts.dataset,
                                      "--compare": opts.compare})
    if opts.compare:
        return _main_compare(opts)
    if opts.server:
        from .serving import run_sweep

        with report_dir(opts.out, opts.overwrite):
            run_sweep(opts)
        return 0
    if opts.engine_report:
        raise UserError("--engine-report is read by --server NAME=URL ...: drop it, or add the servers")
    if not (opts.target and opts.drafter and opts.out):
        raise UserError("needs --target, --drafter and --out (or --compare / --server)")
    opts.template_kwargs()  # bad JSON stops here, before the engine's checks
    check_engine_flags(opts)
    if opts.engine == "vllm":
        from .vllm_engine import vllm_config

        config = vllm_config(opts)  # checked before --out is touched
        with report_dir(opts.out, opts.overwrite):
            return _main_vllm(opts, config)
    from .run import run_eval

    config = decode_config(opts)
    config.check()  # user errors propagate to dflashkit.cli.run_main: one line, exit 2
    with report_dir(opts.out, opts.overwrite):
        check_block_size_flag(opts)  # reads the drafter's config.json: a bad one stops here, before the target
        report = run_eval(opts, config)
    return _summary(report, opts.out)


def _main_compare(opts: EvalOptions) -> int:
    """`--compare`: every report (and its outputs.jsonl) read before --out is touched, then the comparison."""
    from .compare import compare_reports, read_outputs, read_report

    for path in opts.compare:
        read_report(path)
        read_outputs(path)
    with report_dir(opts.out, opts.overwrite):
        print(compare_reports(opts.compare, opts.out))
    return 0


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


def _main_vllm(opts: EvalOptions, config) -> int:
    from .vllm_engine import run_vllm_eval

    report = run_vllm_eval(opts, config)  # user errors: dflashkit.cli.run_main
    print(f"{report['verdict']['text']}\ntau {report['overall']['tau']:.3f} (vLLM, k "
          f"{report['num_speculative_tokens']}); lossless {report['lossless']['identical']}/"
          f"{report['lossless']['requests']} identical; report in {opts.out}")
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
