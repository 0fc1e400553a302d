"""Online training with the target in vLLM against the target in-process (issue 37 item 4): a drafter trained from
vLLM-captured features and one trained from Hugging Face features, same recipe, data, seed and epochs, evaluated
live on MT-bench; goal |tau(vllm) - tau(hf)| <= 0.03 (the seed noise of lab/NOTEBOOK.md's recipe study).

Here, once (the testbed packages are installed here, not on the GPU machine; .cache/ is carried to the GPU machine):
    .venv/bin/python -m lab.testbed_data --out .cache/gpu --sharegpt 0
One H200, after the slim vLLM (../shared/vllm/README.md, /tmp/vllm-site) and the testbed
(../shared/testbed/README.md, /root/testbed/smollm2-bf16) are installed; dflashkit from the checkout
(lab/import_path.sh), vLLM's environment from lab/vllm_env.sh. The data: the first user turn of every
ShareGPT conversation answered by the target (lab/run_lib.sh ``first_turns`` writes $R/regen.jsonl); then one
path per command (each within the 10-minute limit: ~4 min for the epoch, ~1.5 min for the eval, ~1 min for the
engine's start; one process per path also keeps torch.compile's cache of one run from speeding up the other):
    export PYTHONPATH=$(bash lab/import_path.sh /tmp/dflashkit-path):/tmp/site PYTHONSAFEPATH=1 \\
        TOKENIZERS_PARALLELISM=false
    mkdir -p /root/run && bash -c 'T=/root/testbed/smollm2-bf16 D=.cache/gpu R=/root/run NEW=256 SLOTS=2048 \\
        DEV=() LIMIT=(); . lab/run_lib.sh; first_turns'
    for path in hf vllm; do bash lab/vllm_env.sh python3 -m lab.bench_online_vllm --paths $path \\
        --target /root/testbed/smollm2-bf16 --data /root/run/regen.jsonl --dataset .cache/gpu/mtbench.jsonl \\
        --work-dir /root/run/online --out $OUT/online_vllm.json; done
(--paths hf vllm runs both in one process.) Each run adds its paths to the JSON at --out, so the second command
completes the first one's file and computes the difference.
CPU toy (--standin: the capture twin tests/support/vllm_capture_standin.py, which computes HF's features, a 6-layer
random Llama with the testbed's tokenizer, synthetic chats, a 2-step 1-layer drafter; a check that the script runs
and that the two paths give the same losses, not a measurement; lab/tests/test_online_vllm.py):
    .venv/bin/python -m lab.bench_online_vllm --standin --out /tmp/online_vllm.json

What runs, per path (``target_engine`` hf, then vllm): ``load_config(--recipe, overrides)`` exactly as
`dflashkit train --recipe R --target T --data D` builds it (overrides: output_dir, epochs=--epochs, seed=--seed,
wandb/progress off, target_engine, target_gpu_memory_utilization=--gpu-memory-utilization for vllm, then
--overrides), ``train.trainer.train`` in this process (the vllm path starts its engine inside it), then
``eval.run.run_eval`` of the run's export (output_dir/export) in chain mode on --dataset (--num-prompts,
--max-new-tokens, no AR baseline). The recipe (recipes/smollm2-135m.yaml) fits the vLLM path as it is: it leaves
target_layer_ids to the default of a 5-layer drafter, [1, 8, 14, 20, 27] of the testbed's 30 layers (the last,
29, which vLLM reads before the final norm, is not among them), loss dpace and labels data (vLLM gives no
final-norm output for loss=kl or labels=target_argmax).

The JSON (rewritten after each path, so a later failure keeps the earlier results), per path: train wall time
(target load or engine start included), steps, tokens/s (median of the logged windows), the last logged train
loss, the logged train losses by step (each the mean over log_every steps: 10 by default, 1 in the toy), the
final held-out metrics (summary.json: eval/loss, eval/tau_sim, ...), peak GPU memory of the training process
(torch max_memory_allocated / max_memory_reserved, reset before the run; the vLLM engine core is another
process, so its share shows only in ``gpu_used_peak_mib``, the largest whole-GPU used memory nvidia-smi reported
while training, sampled every 2 s), then tau, per-position acceptance and the eval wall time. Across the paths:
tau(vllm) - tau(hf) against the goal, whether the logged per-step losses are equal (on the CPU with the twin both
paths compute the same features in float32: they must be) and their largest difference, and whether both paths
ran the same recipe, data, seed and epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from bench.common import say, write_json
from lab.recipe_study import split_top_level, train_numbers

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("hf", "vllm")
GOAL_TAU_DIFF = 0.03  # |tau(vllm) - tau(hf)|: the seed noise of the recipe study (lab/NOTEBOOK.md)
# --standin: a 1-layer drafter of the 6-layer toy target, 2 steps, every target forward one sample in float32
TOY_OVERRIDES = ("num_hidden_layers=1,block_size=4,max_steps=2,compile=false,mixed_precision=no,"
                 "micro_batch_tokens=256,max_length=128,num_anchors=8,eval_samples=2,eval_anchors=4,save_every=0,"
                 "log_every=1,eval_every=0,num_workers=0,target_layer_ids=[1,3],target_batch_tokens=1,"
                 "drafter={intermediate_size: 64}")


# ----------------------------------------------------------------------------- inputs
def toy_setup(args, work: Path) -> None:
    """--standin: the toy target and chats of bench_capture_vllm.py, the toy sizes, the CPU."""
    from lab.bench_capture_vllm import toy_inputs

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything touches CUDA: the trainer takes a GPU it sees
    if not args.target:
        args.target, data = toy_inputs(work, args.samples or 8)
        args.data = [data]
    args.overrides = [*split_top_level(TOY_OVERRIDES), *args.overrides]
    args.num_prompts = args.num_prompts or 2
    args.max_new_tokens = args.max_new_tokens or 8


def capture_calls(path: str, standin: bool):
    """The vLLM calls of the vllm path: the CPU twin with --standin, else None (the installed vLLM)."""
    if path != "vllm" or not standin:
        return None
    from lab.bench_capture_vllm import capture_api

    return capture_api(True, dummy_weights=False)


def run_config(args, path: str, run_dir: Path):
    """The TrainConfig of one path: the recipe, the bench's overrides, then --overrides; target and data as the
    command's --target / --data flags set them."""
    from dflashkit.train.recipe import load_config

    overrides = [f"output_dir={run_dir}", f"epochs={args.epochs}", f"seed={args.seed}", "wandb=false",
                 "progress=false", f"target_engine={path}"]
    if path == "vllm":
        overrides.append(f"target_gpu_memory_utilization={args.gpu_memory_utilization}")
    return load_config(args.recipe, [*overrides, *args.overrides], target=args.target, data=list(args.data))


# ----------------------------------------------------------------------------- GPU memory
class GpuUsedPeak:
    """The largest whole-GPU used memory (MiB, first GPU) nvidia-smi reports every ``every`` seconds while the
    block runs; ``peak`` stays None without nvidia-smi."""

    def __init__(self, every: float = 2.0):
        self.every, self.peak = every, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def used_mib(self) -> int | None:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split()
        return int(text[0]) if text and text[0].isdigit() else None

    def sample(self) -> None:
        while True:
            used = self.used_mib()
            if used is not None:
                self.peak = max(self.peak or 0, used)
            if self.done.wait(self.every):
                return

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"max_memory_allocated": None, "max_memory_reserved": None}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved()}


def free_memory() -> None:
    import torch

    if torch.cuda.is_available():  # the next engine's start-up profiling refuses to run while memory is freed
        from lab.bench_capture_vllm import free_memory as settle

        settle(torch.device("cuda"))


# ----------------------------------------------------------------------------- one path: train, evaluate
def logged_losses(run_dir: Path) -> dict[str, float]:
    """{step: train/loss} of the run's metrics.jsonl (steps as strings: JSON keys)."""
    from dflashkit.train.tracking import read_metrics

    return {str(r["step"]): r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def train_path(args, path: str, work: Path) -> dict:
    """Train one path in this process; its numbers (module docstring)."""
    from dflashkit.train.trainer import train

    run_dir = work / path / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: never a resume of an earlier bench
    cfg = run_config(args, path, run_dir)
    row = {"target_engine": path, "recipe": args.recipe, "data": list(args.data), "seed": args.seed,
           "epochs": args.epochs, "overrides": list(args.overrides),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if path == "vllm":
        row["target_gpu_memory_utilization"] = args.gpu_memory_utilization
    reset_peak_memory()
    started = time.perf_counter()
    with GpuUsedPeak() as gpu:
        summary = train(cfg, vllm_api=capture_calls(path, args.standin))
    row["train_wall_s"] = time.perf_counter() - started
    row.update(peak_memory(), gpu_used_peak_mib=gpu.peak)
    losses = logged_losses(run_dir)
    row.update(train_numbers(run_dir), train_losses=losses,
               final_train_loss=losses[max(losses, key=int)] if losses else None,
               export_dir=summary.get("export_dir"))
    exported = json.loads((Path(row["export_dir"]) / "config.json").read_text())
    row["target_layer_ids"] = exported["dflash_config"]["target_layer_ids"]
    return row


def eval_path(args, row: dict, work: Path, path: str) -> dict:
    """`dflashkit eval` (chain) of the path's export on --dataset, in this process."""
    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.run import run_eval

    out = work / path / "eval"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    report = run_eval(EvalOptions(target=args.target, drafter=row["export_dir"], out=out, dataset=list(args.dataset),
                                  mode="chain", max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                                  baseline_prompts=0, device="cpu" if args.standin else None, dtype=args.eval_dtype,
                                  time_limit=args.eval_time_limit))
    overall = report["overall"]
    return {"tau": overall["tau"], "rounds": overall.get("rounds"), "prompts": overall.get("prompts"),
            "per_position_acceptance": overall.get("per_position_acceptance"),
            "eval_wall_s": time.perf_counter() - started, "eval_partial": "partial" in report,
            "eval_report": str(out / "report.json")}


def run_path(args, path: str, work: Path) -> dict:
    row = train_path(args, path, work)
    say(f"{path}: trained in {row['train_wall_s']:.0f} s ({row.get('step')} steps, last loss "
        f"{row['final_train_loss']}); evaluating")
    free_memory()
    row.update(eval_path(args, row, work, path), status="done")
    say(f"{path}: tau {row['tau']:.3f}")
    return row


# ----------------------------------------------------------------------------- comparison, report
SAME_SETUP = ("recipe", "data", "seed", "epochs", "overrides")


def compare(rows: dict) -> dict:
    """tau(vllm) - tau(hf) against the goal and the logged losses of the two paths, when both are done."""
    hf, vl = rows.get("hf", {}), rows.get("vllm", {})
    if hf.get("status") != "done" or vl.get("status") != "done":
        return {}
    diff = vl["tau"] - hf["tau"]
    a, b = hf.get("train_losses") or {}, vl.get("train_losses") or {}
    common = sorted(set(a) & set(b), key=int)
    return {"tau_vllm_minus_hf": diff, "goal_abs_tau_diff": GOAL_TAU_DIFF, "within_goal": abs(diff) <= GOAL_TAU_DIFF,
            "per_step_losses_equal": bool(a) and a == b, "logged_steps": len(common),
            "max_abs_loss_diff": max((abs(a[s] - b[s]) for s in common), default=None),
            "final_train_loss_diff": (vl["final_train_loss"] - hf["final_train_loss"]
                                      if None not in (vl.get("final_train_loss"), hf.get("final_train_loss"))
                                      else None),
            "same_setup": all(hf.get(k) == vl.get(k) for k in SAME_SETUP)}


def print_table(results: dict) -> None:
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    print("path | tau | steps | train s | tokens/s | last loss | eval/loss | peak alloc GiB | GPU used MiB | eval s")
    for path, r in results["paths"].items():
        alloc = r.get("max_memory_allocated")
        print(" | ".join([path, num(r.get("tau"), ".3f"), num(r.get("step"), "d"), num(r.get("train_wall_s"), ".0f"),
                          num(r.get("train_tokens_per_s_median"), ",.0f"), num(r.get("final_train_loss"), ".4f"),
                          num(r.get("eval/loss"), ".4f"), num(alloc / 2**30 if alloc else None, ".2f"),
                          num(r.get("gpu_used_peak_mib"), "d"), num(r.get("eval_wall_s"), ".0f")])
              + (f" | FAILED {r['error']}" if "error" in r else ""))
    c = results.get("comparison") or {}
    if c:
        print(f"tau(vllm) - tau(hf) = {c['tau_vllm_minus_hf']:+.3f} (goal within +-{GOAL_TAU_DIFF}: "
              f"{c['within_goal']}); per-step losses equal: {c['per_step_losses_equal']} (max diff "
              f"{num(c['max_abs_loss_diff'], '.2e')} over {c['logged_steps']} logged steps); same setup: "
              f"{c['same_setup']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to train")
    what.add_argument("--target", help="the target (the testbed: /root/testbed/smollm2-bf16; --standin: a toy)")
    what.add_argument("--data", action="append", help="chat data, a regeneration's jsonl (repeatable)")
    what.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m.yaml"))
    what.add_argument("--epochs", type=int, default=1)
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--overrides", default="", help="key=value,... after the recipe, for both paths")
    what.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="target engines, in order")
    what.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                      help="the vllm path's target_gpu_memory_utilization")
    ev = p.add_argument_group("evaluation (dflashkit eval, chain)")
    ev.add_argument("--dataset", nargs="+", default=["builtin:mtbench"], help="MT-bench jsonl (or builtin:mtbench)")
    ev.add_argument("--num-prompts", type=int, default=None, help="default 80 (--standin: 2)")
    ev.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (--standin: 8)")
    ev.add_argument("--eval-dtype", default=None, help="default: bfloat16 on the GPU, float32 on the CPU")
    ev.add_argument("--eval-time-limit", type=float, default=None, metavar="S", help="eval --time-limit")
    run = p.add_argument_group("how to run")
    run.add_argument("--out", default="bench_online_vllm.json", help="the JSON (paths already in it are kept)")
    run.add_argument("--work-dir", help="run and eval directories (default: a temporary dir, removed)")
    run.add_argument("--standin", "--toy", dest="standin", action="store_true",
                     help="CPU toy: the capture twin, a tiny random target, synthetic chats, a 2-step drafter")
    run.add_argument("--samples", type=int, default=None, help="--standin: synthetic chats (default 8)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.overrides = split_top_level(args.overrides)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-online-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.standin:
        toy_setup(args, work)
    args.num_prompts = args.num_prompts or 80
    args.max_new_tokens = args.max_new_tokens or 256
    if not (args.target and args.data):
        build_parser().error("--target and --data are needed (or --standin)")
    import torch

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}  # an earlier command's paths are kept
    results.update(args=vars(args), torch=torch.__version__,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    results.setdefault("paths", {})
    ok = True
    for path in args.paths:
        say(f"{path}: training")
        try:
            results["paths"][path] = run_path(args, path, work)
        except Exception as error:  # one failed path must not lose the other
            ok = False
            results["paths"][path] = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                                      "traceback": traceback.format_exc()}
            say(f"{path}: failed: {type(error).__name__}: {error}")
        free_memory()
        results["comparison"] = compare(results["paths"])
        write_json(out, results)
    print_table(results)
    print(f"wrote {out}")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
