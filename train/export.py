"""Export any training checkpoint as a drafter directory (the format vLLM, SGLang and the reference load).

    python -m dflashkit.train.export runs/smollm2/checkpoints/step-00001200 drafters/smollm2
    python -m dflashkit.train.export runs/smollm2 drafters/smollm2          # newest complete checkpoint
    python -m dflashkit.train.export CKPT DIR --dtype float32           # default bfloat16
    python -m dflashkit.train.export CKPT DIR --overwrite   # DIR holds something else: replace it anyway
    python -m dflashkit.train.export CKPT DIR --for vllm                # refuse what vLLM 0.24 serves unlike training

The checkpoint's fp32 master weights and its DrafterConfig (trainer.json) are loaded into a fresh drafter and
written with ``dflashkit.drafter.save_drafter`` in bfloat16 (the published drafters' dtype; a float32 config
would make SGLang and vLLM serve the drafter in float16), with the config's ``dtype`` set to the weights';
an incomplete, corrupted or altered checkpoint (trainer.json checked field by field) and one holding NaN or Inf
weights are refused. The installed vLLM's rules (drafter/engines.py VLLM_RULES; 0.26 when none is): a tap
of the last target layer, or sliding-window drafter layers on 0.24, are warned about, or refused with ``--for vllm``;
the printed serve command sets num_speculative_tokens = block_size - 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from dflashkit.errors import UserError

from .checkpoint import (
    check_trainer_state,
    latest_checkpoint,
    nonfinite_tensor,
    read_trainer_state,
    read_weights,
    verify_checkpoint,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, or a run's output dir (its newest complete checkpoint)."""
    path = Path(path)
    if (path / "checkpoint.json").is_file() or path.name.startswith("step-"):
        return path
    found = latest_checkpoint(path, warn=lambda msg: print(msg))
    if found is None:
        raise UserError(f"{path}: neither a checkpoint (checkpoint.json) nor a run directory with complete "
                        f"checkpoints under {path}/checkpoints")
    return found


def load_checkpoint_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The drafter stored in a training checkpoint (eval mode, CPU)."""
    from dflashkit.drafter import DrafterConfig, build_drafter

    path = resolve_checkpoint(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UserError(f"checkpoint {path} cannot be exported: {problem}")
    state = check_trainer_state(read_trainer_state(path), path, fields=("drafter_config",))
    dcfg = DrafterConfig.from_json_dict(state["drafter_config"], source=f"{path}/trainer.json")
    model = build_drafter(dcfg)
    weights = read_weights(path)
    bad = nonfinite_tensor(weights)
    if bad is not None:  # training stops before writing such a checkpoint; this one was written otherwise
        raise UserError(f"{path}/model.safetensors: tensor {bad} holds NaN or Inf; a diverged drafter is never "
                        f"exported: export an earlier checkpoint")
    expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
    if set(weights) != expected:
        raise UserError(f"{path}/model.safetensors: tensors {sorted(set(weights) ^ expected)[:6]} do not match the "
                        f"drafter_config in trainer.json")
    model.load_state_dict(weights, strict=False)
    return model.to(dtype).eval()


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                      engine: str = "all", overwrite: bool = False, flag: str = "--overwrite") -> Path:
    """engine: "all" (warn about what vLLM 0.24 serves differently) or "vllm" (refuse it); drafter/engines.py.
    An existing ``out_dir`` is replaced only when it holds an export, or with ``overwrite`` (``flag``: the option
    the refusal names); checked before the checkpoint is read."""
    from dflashkit.drafter import save_drafter
    from dflashkit.drafter.engines import check_export_for
    from dflashkit.drafter.export import export_dir_problem
    from dflashkit.outputs import check_output_dir

    check_output_dir(out_dir, what="a drafter directory", problem=export_dir_problem, overwrite=overwrite, flag=flag)
    model = load_checkpoint_drafter(path, dtype)
    check_export_for(model.dflash, engine, warn=lambda message: print(message, file=sys.stderr))
    chat = read_trainer_state(resolve_checkpoint(path)).get("chat") or {}  # what eval renders prompts with
    return save_drafter(model, out_dir, overwrite=overwrite, flag=flag, chat=chat)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflashkit export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint dir (…/checkpoints/step-N) or a run output dir (newest)")
    ap.add_argument("out_dir", help="where to write the drafter directory")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="weight dtype of the export (default bfloat16; config.json's dtype follows it)")
    ap.add_argument("--for", dest="engine", choices=["all", "vllm"], default="all",
                    help="all: an export every engine loads (warns what vLLM 0.24 serves differently); vllm: "
                         "refuse a drafter vLLM 0.24 would serve unlike its training (drafter/engines.py)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace out_dir even when it is not a drafter export (a file there is never replaced)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir, DTYPES[args.dtype], args.engine,
                            overwrite=args.overwrite)  # errors: cli.run_main
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    from dflashkit.drafter import read_drafter_config
    from dflashkit.drafter.engines import vllm_serve_command

    print("serve with vLLM: " + vllm_serve_command("TARGET", out, read_drafter_config(out).block_size))
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit export", main))
