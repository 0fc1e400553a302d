"""Train a DFlash drafter: online (the target runs in the loop on chat data) or on feature shards.

Online, the recommended path when the target fits on the training GPUs (train/online.py):
    python -m dflashkit.train --recipe recipes/smollm2-135m-cpu.yaml --target testbed:smollm2 \\
        --data builtin:sharegpt data_limit=256                                      # CPU, a short run
    python -m dflashkit.train --recipe recipes/smollm2-135m.yaml --target testbed:smollm2 --data chats.jsonl
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 8 \\
        -m dflashkit.train --recipe recipes/qwen3-8b.yaml --target /models/Qwen3-8B --data chats.jsonl
A target too large for the training GPU (or a hybrid one without its kernels in Hugging Face) in a vLLM engine of
the one training process, spread over 2 GPUs (train/online_vllm.py; the first GPU also trains the drafter):
    python -m dflashkit.train --recipe recipes/qwen3.6-27b.yaml --target /models/Qwen3.6-27B --data chats.jsonl \\
        --target-engine vllm --tensor-parallel-size 2 --gpu-memory-utilization 0.6
Several machines (run the same line on each, with its --machine_rank; README "Several machines"):
    accelerate launch --config_file recipes/accelerate/multinode.yaml --machine_rank 0 \\
        --main_process_ip 10.0.0.1 -m dflashkit.train --recipe recipes/qwen3-8b.yaml --target ... --data ...

On feature shards (`dflashkit extract`; for a target too large to run every epoch, or features reused by many
runs). CPU (a short testbed run):
    python -m dflashkit.train --recipe recipes/smollm2-135m-cpu.yaml shards=data/smollm2-shards

One GPU:
    python -m dflashkit.train --recipe recipes/smollm2-135m.yaml shards=data/smollm2-shards

Several GPUs of one host (DDP; FSDP and DeepSpeed ZeRO-2/3 with the other accelerate configs in recipes/):
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 8 \\
        -m dflashkit.train --recipe recipes/qwen3-8b.yaml shards=data/qwen3-8b-shards
    accelerate launch --config_file recipes/accelerate/zero2.yaml --num_processes 8 \\
        -m dflashkit.train --recipe recipes/qwen3-8b.yaml shards=data/qwen3-8b-shards

Fine-tune a published drafter on your own domain, resume, export:
    python -m dflashkit.train --recipe recipes/qwen3-8b.yaml shards=my-shards --init-from z-lab-drafter/ lr=1e-4
    python -m dflashkit.train --recipe recipes/qwen3-8b.yaml shards=my-shards --resume auto   # the default
    python -m dflashkit.train.export runs/qwen3-8b/checkpoints/step-00012000 drafters/qwen3-8b

Every field of train/config.py:TrainConfig can be set in the recipe or as key=value after it
(``lr=3e-4 loss=dpace epochs=2``); the flags below are shorthands for the common ones.

SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) writes a checkpoint at the current step and exits 0; the
same command resumes from it, and `dflashkit export` exports it. A loss, gradient norm or weight that becomes NaN
or Inf stops the run at that step with exit status 1, naming the step and the last finite checkpoint; nothing
of the diverged run is saved or exported. resume=none into an earlier run's output_dir is refused (overwrite=true
deletes that run and starts over).
"""

from __future__ import annotations

import argparse
import sys

from .config import LOSSES, TARGET_ENGINES
from .recipe import load_config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflashkit train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="recipe YAML (recipes/NAME.yaml)")
    ap.add_argument("--shards", help="feature shard directory (= shards=DIR)")
    ap.add_argument("--target", help="online: the target to run (HF dir, .gguf, testbed:smollm2) (= target=T)")
    ap.add_argument("--data", action="append", help="online: chat data (jsonl/json/parquet, dir, builtin:NAME); "
                                                     "repeat for several (= data=[...])")
    ap.add_argument("--output-dir", help="run directory for checkpoints, metrics and the export (= output_dir=DIR)")
    ap.add_argument("--init-from", help="start from this drafter directory (= init_from=DIR)")
    ap.add_argument("--resume", help="'auto' (default), 'none', or a checkpoint directory (= resume=...)")
    ap.add_argument("--loss", choices=LOSSES, help="training objective (= loss=...)")
    ap.add_argument("--target-engine", choices=TARGET_ENGINES,
                    help="online: what runs the target: hf (in each training process, the default) or vllm (a vLLM "
                         "engine of the one process) (= target_engine=...)")
    ap.add_argument("--tensor-parallel-size", type=int, help="--target-engine vllm: GPUs the engine spreads the "
                                                             "target over (= target_tensor_parallel_size=N)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="--target-engine vllm: share of each GPU the engine takes (= target_gpu_memory_utilization=F)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="any TrainConfig field")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``key=value`` overrides may come before, between or after the flags."""
    return build_parser().parse_intermixed_args(argv)


# flag (argparse dest) -> the TrainConfig field it sets
FLAG_FIELDS = {**{f: f for f in ("shards", "target", "output_dir", "init_from", "resume", "loss", "target_engine")},
               "tensor_parallel_size": "target_tensor_parallel_size",
               "gpu_memory_utilization": "target_gpu_memory_utilization"}


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of a parsed command line: the recipe, the overrides, then the flags."""
    flags = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()
             if getattr(args, flag) is not None}  # taken as they are: a flag's value is never parsed as YAML
    if args.data:
        flags["data"] = list(args.data)
    return load_config(args.recipe, list(args.overrides), **flags)


def main(argv: list[str] | None = None) -> int:
    from dflashkit import IMPORTED_AT  # the process's start: the run's clock counts its imports

    cfg = config_from_args(parse_args(argv))
    from dflashkit.files import disk_full_is_user_error

    from .run_dir import main_process
    from .train_step import TrainingDiverged
    from .trainer import train

    try:
        # a user error (a full disk too) propagates to dflashkit.cli.run_main: one line, exit 2
        with disk_full_is_user_error(cfg.output_dir, then="run the same command again: it resumes from the last "
                                                          "checkpoint"):
            train(cfg, started=IMPORTED_AT)
    except TrainingDiverged as e:  # valid input, failed run: one line (every rank stopped alike), exit 1
        if main_process():
            print(f"dflashkit train: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit train", main))
