"""`dflashkit demo`: the whole pipeline on the SmolLM2-135M-Instruct testbed, one stage after another.

    make demo                                   # a CUDA GPU: the GPU scale (full); else the CPU check (small)
    dflashkit demo --device cpu --scale small   # the CPU check anywhere: about a quarter of an hour on 2 cores
    dflashkit demo --device cuda --scale full   # one GPU: a few thousand conversations, a useful drafter

Without flags the demo runs where dflashkit/launch.py puts a process (its local device: this rank's GPU when CUDA
is available, else the CPU) and at that device's scale (``demo_plan``: full on a GPU, small on the CPU); explicit
``--device`` / ``--scale`` win. It says which it chose before the first stage, and the CPU check's table says what
it is and what the GPU scale gives.

Stages (each writes into the run directory; a finished stage leaves ``stages/<name>.json`` with its command
and wall time, and running the demo again resumes after the last finished stage):

    regenerate  ShareGPT prompts answered by the target itself       -> regen.jsonl
    extract     target-layer features of those conversations          -> shards/
    train       the drafter, exported at the end                       -> train/ , drafter/
    eval-chain  live speculative decoding on MT-bench, chain          -> eval-chain/report.md
    eval-tree   the same prompts with tree verification               -> eval-tree/report.md

Each stage calls the library function behind the command a user runs by hand, with explicit keyword arguments
(printed before it runs, and stored in ``stages/<name>.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflashkit.errors import UserError
from dflashkit.files import atomic_write
from dflashkit.options import build_parser as options_parser
from dflashkit.options import option, parse_options
from dflashkit.outputs import check_apart
from dflashkit.train.config import LOSSES

TARGET = "testbed:smollm2"
MASK_TOKEN_ID = 16  # SmolLM2's reserved <empty_output>: its tokenizer has no mask token and no spare rows
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# The autoregressive baseline and the lossless reference of each prompt, kept across the eval stages of one
# demo process: chain and tree decode the same prompts with the same target, so they need them once.
AR_RUNS: dict = {}

# Where the GPU scale's latest measurement is, named under the CPU check's table (a figure here would go stale)
GPU_SCALE_MEASURED = ("has its latest measurement in the repository's docs/results.md "
                      "(\"What does the demo's GPU scale give?\")")

# What each scale runs. small: the CPU check of `make demo` (the AR baseline and the lossless check on 3 of the 6
# prompts: a CPU decode step is mostly Python, so its speedup says little); full: one GPU.
SCALES = {
    "small": dict(train_prompts=96, regen_new_tokens=96, max_turns=1, max_length=512, eval_prompts=6,
                  eval_new_tokens=64, recipe="smollm2-135m-cpu.yaml", train_overrides={}, tree_budget=32,
                  batch_size=16, eval_datasets=["builtin:mtbench"], baseline_prompts=3),
    # one GPU, one process: eval of all 244 prompts, AR baseline on 10 each
    "full": dict(train_prompts=6144, regen_new_tokens=384, max_turns=1, max_length=1024, eval_prompts=None,
                 eval_new_tokens=256, recipe="smollm2-135m.yaml", train_overrides={"epochs": 3}, tree_budget=64,
                 batch_size=512, eval_datasets=["builtin:mtbench", "builtin:humaneval"], baseline_prompts=10),
}


# --------------------------------------------------------------------------- the library calls of the stages
def regenerate(**flags) -> dict:
    """ShareGPT prompts answered by the target (dflashkit.extract.regenerate; ``flags``: RegenerateOptions
    fields)."""
    from dflashkit.extract.options import RegenerateOptions
    from dflashkit.extract.regenerate import regenerate as run_regeneration

    return run_regeneration(RegenerateOptions(**flags))


def extract(**flags) -> dict:
    """Target-layer features into shards (dflashkit.extract; ``flags``: ExtractOptions fields)."""
    from dflashkit.extract.options import ExtractOptions
    from dflashkit.extract.run import extract as run_extraction

    return run_extraction(ExtractOptions(**flags))


def train(recipe: str, overrides: list[str] | tuple = (), **fields) -> dict:
    """The drafter, trained from a recipe, then ``key=value`` overrides, then TrainConfig fields, and exported at
    the end (dflashkit.train)."""
    from dflashkit.train.recipe import load_config
    from dflashkit.train.trainer import train as run_training

    return run_training(load_config(recipe, overrides, **fields))


def evaluate(target: str, drafter: str, out: str, dataset: list[str], mode: str = "chain", tree_budget: int = 64,
             max_new_tokens: int = 256, **kwargs) -> dict:
    """Live speculative decoding and its report (dflashkit.eval); ``kwargs`` are further fields of its options
    (eval/options.py ``EvalOptions``)."""
    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.run import run_eval

    opts = EvalOptions(target=target, drafter=drafter, out=out, dataset=dataset, mode=mode, tree_budget=tree_budget,
                       max_new_tokens=max_new_tokens, **kwargs)
    return run_eval(opts, shared_baseline=AR_RUNS)


def stage_calls(run: Path, scale: dict, device: str, loss: str | None, target: str = TARGET,
                train_data: str = "builtin:sharegpt", eval_data: list[str] | None = None
                ) -> list[tuple[str, Callable[..., dict], dict]]:
    """(stage name, library function, its keyword arguments), in pipeline order."""
    hardware = dict(device=device, dtype="float32" if device == "cpu" else "bfloat16")
    train_fields = dict(shards=str(run / "shards"), output_dir=str(run / "train"), export_dir=str(run / "drafter"),
                        mask_token_id=MASK_TOKEN_ID, max_length=scale["max_length"], target=target,
                        **scale["train_overrides"])
    if loss:
        train_fields["loss"] = loss
    if device == "cpu":
        train_fields["mixed_precision"] = "no"
    eval_common = dict(target=target, drafter=str(run / "drafter"), dataset=list(eval_data or scale["eval_datasets"]),
                       num_prompts=scale["eval_prompts"], baseline_prompts=scale["baseline_prompts"],
                       max_new_tokens=scale["eval_new_tokens"], **hardware)
    return [
        ("regenerate", regenerate, dict(target=target, data=[train_data], limit=scale["train_prompts"],
                                        out=str(run / "regen.jsonl"), resume=True,
                                        max_new_tokens=scale["regen_new_tokens"], batch_size=scale["batch_size"],
                                        max_prompt_length=scale["max_length"] // 2, max_turns=scale["max_turns"],
                                        **hardware)),
        ("extract", extract, dict(target=target, data=[str(run / "regen.jsonl")], out=str(run / "shards"),
                                  num_taps=5, max_length=scale["max_length"], resume=True,
                                  store_last_hidden=loss == "kl", **hardware)),
        ("train", train, dict(recipe=str(RECIPES / scale["recipe"]), **train_fields)),
        ("eval-chain", evaluate, dict(eval_common, mode="chain", out=str(run / "eval-chain"))),
        ("eval-tree", evaluate, dict(eval_common, mode="tree", tree_budget=scale["tree_budget"],
                                     out=str(run / "eval-tree"))),
    ]


def demo_plan(device: str | None, scale: str | None, cuda_available: bool) -> tuple[str, str]:
    """(device, scale) of a demo run: the flags as given; a missing device is the local device of
    dflashkit/launch.py (``cuda``, this rank's GPU, when ``cuda_available``; else ``cpu``), a missing scale that
    device's (``full`` on a GPU, ``small`` on the CPU)."""
    if device is None:
        device = "cuda" if cuda_available else "cpu"
    if scale is None:
        scale = "small" if device == "cpu" else "full"
    return device, scale


def plan_line(device: str, scale: str, chosen: bool) -> str:
    """What the run is, printed before its first stage."""
    what = ("the GPU scale" if scale == "full" else "the pipeline check") + f" (--device {device} --scale {scale})"
    if not chosen:
        return f"[demo] {what}, as the flags say"
    other = ("; `--device cpu --scale small` runs the CPU check instead" if device != "cpu" else
             f"; no CUDA GPU here. On one, `make demo` runs the GPU scale, which {GPU_SCALE_MEASURED}")
    return f"[demo] {what}, chosen for this machine{other}"


def summary(run: Path, scale: str = "small") -> str:
    reports = {}
    for mode in ("chain", "tree"):
        f = run / f"eval-{mode}" / "report.json"
        if f.is_file():
            reports[mode] = json.loads(f.read_text())
    if not reports:
        return "no evaluation report yet"
    lines = ["| mode | τ | rounds | speedup | verify ÷ AR step | per-position acceptance (k = 1, 2, 3, ...) |",
             "|---|---|---|---|---|---|"]
    for mode, rep in reports.items():
        o = rep["overall"]
        per_pos = " ".join(f"{p:.2f}" for p in o.get("per_position_acceptance", [])[:8])
        lines.append(f"| {mode} | {o['tau']:.2f} | {o.get('rounds', '-')} | {_num(o.get('speedup'))} "
                     f"| {_num(o.get('verify_over_ar_step'))} | {per_pos} |")
    lines.append("")
    if scale == "small":
        lines += ["This is the pipeline check (--scale small: 96 prompts, a one-layer drafter): it shows that every "
                  "stage runs, not what a drafter reaches. The GPU scale (`make demo` on a CUDA machine) "
                  + GPU_SCALE_MEASURED + ".", ""]
    else:
        lines += [f"This is the GPU scale (--scale full); it {GPU_SCALE_MEASURED}.", ""]
    for mode in reports:
        d = run / f"eval-{mode}"
        plots = ", ".join(sorted(p.name for p in d.glob("*.png")))
        lines.append(f"{mode}: {d / 'report.md'}  (plots: {plots})")
    return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


@dataclass
class DemoOptions:
    """The command line of `dflashkit demo` (dflashkit/options.py)."""

    run_dir: str = option("runs/demo", help="where every stage writes (default runs/demo)")
    device: str | None = option(None, help="cpu or cuda (default: this machine's GPU when CUDA is available, else "
                                           "cpu)")
    target: str = option(TARGET, help="the testbed as installed (default testbed:smollm2) or a converted copy of "
                                      "it")
    scale: str | None = option(None, help="small: CPU check; full: GPU run (default: full on a GPU, small on the "
                                          "CPU)", choices=sorted(SCALES))
    train_data: str = option("builtin:sharegpt", help="prompts to regenerate (default ShareGPT)")
    eval_data: list[str] | None = option(None, help="evaluation datasets (default: MT-bench; full adds HumanEval)",
                                         nargs="+")
    loss: str | None = option(None, help="training objective (recipe default)", choices=LOSSES)
    restart: bool = option(False, help="forget finished stages and run all again")


def build_parser() -> argparse.ArgumentParser:
    return options_parser(DemoOptions, prog="dflashkit demo", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    return run_demo(parse_options(DemoOptions, argv, build_parser()))


def run_demo(options: DemoOptions) -> int:
    """The demo's stages in order under ``options.run_dir``, each skipped when it finished before with the same
    arguments; then the stage times and the summary table."""
    from dflashkit import launch

    device, scale = demo_plan(options.device, options.scale, cuda_available=launch.local_device().type == "cuda")
    print(plan_line(device, scale, chosen=options.device is None or options.scale is None), flush=True)
    run = Path(options.run_dir)
    check_apart({"--run-dir": run}, {"--target": options.target, "--train-data": options.train_data,
                                     "--eval-data": options.eval_data})
    stages_dir = run / "stages"
    stages_dir.mkdir(parents=True, exist_ok=True)
    if options.restart:
        for f in stages_dir.glob("*.json"):
            f.unlink()
    timings = {}
    for name, function, kwargs in stage_calls(run, SCALES[scale], device, options.loss, options.target,
                                               options.train_data, options.eval_data):
        done = stages_dir / f"{name}.json"
        if done.is_file():
            earlier = json.loads(done.read_text())
            if "kwargs" in earlier and earlier["kwargs"] != json.loads(json.dumps(kwargs)):  # another scale, device
                raise UserError(f"{run}: its stage {name} ran with other settings ({earlier.get('kwargs')}); give "
                                "another --run-dir, or --restart to run every stage again there")
            timings[name] = earlier["seconds"]
            print(f"[demo] {name}: done already ({timings[name]:.0f} s), skipping")
            continue
        call = f"{function.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        print(f"\n[demo] {name}: {call}", flush=True)
        start = time.perf_counter()
        try:
            function(**kwargs)
        except Exception:
            print(f"[demo] stage {name} failed; fix the cause and run the demo again: finished stages are kept",
                  file=sys.stderr)
            raise
        timings[name] = time.perf_counter() - start
        atomic_write(done, (json.dumps({"call": function.__name__, "kwargs": kwargs, "seconds": timings[name]},
                                       indent=1) + "\n").encode())
    print("\n[demo] stage wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    print(summary(run, scale))
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit demo", main))
