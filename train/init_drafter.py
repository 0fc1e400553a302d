"""`dflashkit init-drafter`: write a randomly initialised drafter export for a target.

Lets a user see and check the config (taps, block size, mask token, layer layout) before any training, and
gives tests and benchmarks a drafter in the exact export format. It takes the road of training: a recipe and
``key=value`` overrides become a TrainConfig (train/config.py), and the trainer's model builder makes the drafter,
so the drafter written here is the one `dflashkit train` would start from.

    dflashkit init-drafter --target testbed:smollm2 --out runs/drafter0 --num-layers 3 --block-size 16 \\
        --mask-token-id 16
    dflashkit init-drafter --target /models/Qwen3-8B --out drafter0 --recipe recipes/qwen3-8b.yaml
    python -m dflashkit.train.init_drafter --target /models/Qwen3-8B --out drafter0 target_layer_ids=[1,9,17,25,33]

--out is replaced only when it already holds a drafter export (or is empty), --overwrite or not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflashkit.errors import UserError

from .config import TrainConfig, load_config

LAYER_TYPE_NAMES = {"full": "full_attention", "sliding": "sliding_attention",
                    "full_attention": "full_attention", "sliding_attention": "sliding_attention"}


def parse_layer_types(text: str | None, num_layers: int) -> list[str] | None:
    """'full' / 'sliding' / a comma list like 'sliding,sliding,full' -> layer_types."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in LAYER_TYPE_NAMES]
    if bad:
        raise UserError(f"--layer-types: unknown {bad}; use full, sliding or a comma list of them")
    if len(parts) == 1:
        parts = parts * num_layers
    if len(parts) != num_layers:
        raise UserError(f"--layer-types has {len(parts)} entries for {num_layers} drafter layers; give one per layer "
                        f"or a single type for all")
    return [LAYER_TYPE_NAMES[p] for p in parts]


def init_drafter(cfg: TrainConfig, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False):
    """Build a new drafter for ``cfg.target`` as training does (seeded by ``cfg.seed``) and export it to
    ``out_dir`` (replaced only when it is an export); returns (export path, DrafterConfig)."""
    from dflashkit.drafter import save_drafter
    from dflashkit.drafter.export import export_dir_problem
    from dflashkit.outputs import check_apart, check_output_dir
    from dflashkit.targets.loading import load_target_head

    from .setup import build_model

    if not cfg.target:
        raise UserError("target: no target given; pass --target (an HF model dir, a .gguf file or testbed:smollm2)")
    if cfg.init_from:
        raise UserError(f"init_from={cfg.init_from}: init-drafter writes a new drafter; drop init_from")
    check_apart({"--out": out_dir}, {"--target": cfg.target})
    check_output_dir(out_dir, what="a drafter directory", problem=export_dir_problem, overwrite=overwrite)
    torch.manual_seed(cfg.seed)
    head = load_target_head(cfg.target)
    model, dcfg = build_model(cfg, {}, head)
    return save_drafter(model, out_dir, dtype=dtype, overwrite=overwrite), dcfg


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflashkit init-drafter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF model dir, .gguf file or testbed:smollm2")
    ap.add_argument("--out", required=True, help="export directory to write")
    ap.add_argument("--recipe", help="a training recipe (recipes/NAME.yaml): its drafter fields are used")
    ap.add_argument("--num-layers", type=int, help="drafter decoder layers (= num_hidden_layers; default 5)")
    ap.add_argument("--block-size", type=int, help="tokens per block (= block_size; default 16)")
    ap.add_argument("--target-layer-ids", type=int, nargs="+", help="decoder layers to tap (default: evenly spaced)")
    ap.add_argument("--mask-token-id", type=int, help="MASK id (default: tokenizer's mask token or a spare row)")
    ap.add_argument("--layer-types", help="full, sliding, or a comma list per layer (default full)")
    ap.add_argument("--sliding-window", type=int, help="window of sliding layers")
    ap.add_argument("--seed", type=int, help="init seed (= seed; default 0)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--overwrite", action="store_true",
                    help="accepted for older scripts: a drafter export at --out is replaced anyway, anything "
                         "else never is")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="any TrainConfig field (train/config.py)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``key=value`` overrides may come before, between or after the flags."""
    return build_parser().parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = {"target": args.target, "num_hidden_layers": args.num_layers, "block_size": args.block_size,
             "target_layer_ids": args.target_layer_ids, "mask_token_id": args.mask_token_id,
             "sliding_window": args.sliding_window, "seed": args.seed}
    cfg = load_config(args.recipe, args.overrides, **{k: v for k, v in flags.items() if v is not None})
    if args.layer_types:
        cfg.layer_types = parse_layer_types(args.layer_types, cfg.num_hidden_layers)
    out, dcfg = init_drafter(cfg, args.out, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    summary = {k: v for k, v in dcfg.to_json_dict().items()
               if k in ("hidden_size", "num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id",
                        "layer_types", "sliding_window", "vocab_size")}
    print(f"wrote {out}\n{json.dumps(summary, indent=1)}")
    return 0


if __name__ == "__main__":
    import sys

    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit init-drafter", main))
