"""Export any training checkpoint as a drafter directory (the format vLLM, SGLang and the reference load).

    python -m dflashkit.train.export runs/smollm2/checkpoints/step-00001200 drafters/smollm2
    python -m dflashkit.train.export runs/smollm2 drafters/smollm2          # newest complete checkpoint
    python -m dflashkit.train.export CKPT DIR --dtype float32           # default bfloat16

The checkpoint's fp32 master weights and its DrafterConfig (trainer.json) are loaded into a fresh drafter and
written with ``dflashkit.drafter.save_drafter`` in bfloat16 (the published drafters' dtype; a float32 config
would make SGLang and vLLM serve the drafter in float16), with the config's ``dtype`` set to the weights';
an incomplete or corrupted checkpoint is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from .checkpoint import latest_checkpoint, read_trainer_state, read_weights, verify_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, or a run's output dir (its newest complete checkpoint)."""
    path = Path(path)
    if (path / "checkpoint.json").is_file() or path.name.startswith("step-"):
        return path
    found = latest_checkpoint(path, warn=lambda msg: print(msg))
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint (checkpoint.json) nor a run directory with complete "
                                f"checkpoints under {path}/checkpoints")
    return found


def load_checkpoint_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The drafter stored in a training checkpoint (eval mode, CPU)."""
    from dflashkit.drafter import DrafterConfig, build_drafter

    path = resolve_checkpoint(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be exported: {problem}")
    state = read_trainer_state(path)
    dcfg = DrafterConfig.from_json_dict(state["drafter_config"], source=f"{path}/trainer.json")
    model = build_drafter(dcfg)
    weights = read_weights(path)
    expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
    if set(weights) != expected:
        raise ValueError(f"{path}/model.safetensors: tensors {sorted(set(weights) ^ expected)[:6]} do not match the "
                         f"drafter_config in trainer.json")
    model.load_state_dict(weights, strict=False)
    return model.to(dtype).eval()


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    from dflashkit.drafter import save_drafter

    return save_drafter(load_checkpoint_drafter(path, dtype), out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflashkit export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint dir (…/checkpoints/step-N) or a run output dir (newest)")
    ap.add_argument("out_dir", help="where to write the drafter directory")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="weight dtype of the export (default bfloat16; config.json's dtype follows it)")
    args = ap.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, DTYPES[args.dtype])
    except (ValueError, FileNotFoundError) as e:
        print(f"dflashkit export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit export", main))
