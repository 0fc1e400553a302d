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
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashkit.errors import UserError
from dflashkit.options import build_parser as options_parser
from dflashkit.options import option, options_from

from .config import TrainConfig
from .recipe import load_config

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

    from .setup_drafter import build_model

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


@dataclass
class InitDrafterOptions:
    """The command line of `dflashkit init-drafter` (dflashkit/options.py): where the drafter goes, and the
    training config it is built from (a recipe, its drafter flags, ``key=value`` overrides)."""

    target: str = option(help="HF model dir, .gguf file or testbed:smollm2", required=True)
    out: str = option(help="export directory to write", required=True)
    recipe: str | None = option(None, help="a training recipe (recipes/NAME.yaml): its drafter fields are used")
    num_layers: int | None = option(None, help="drafter decoder layers (= num_hidden_layers; default 5)", parse=int)
    block_size: int | None = option(None, help="tokens per block (= block_size; default 16)", parse=int)
    target_layer_ids: list[int] | None = option(None, help="decoder layers to tap (default: evenly spaced)",
                                                parse=int, nargs="+")
    mask_token_id: int | None = option(None, help="MASK id (default: tokenizer's mask token or a spare row)",
                                       parse=int)
    layer_types: str | None = option(None, help="full, sliding, or a comma list per layer (default full)")
    sliding_window: int | None = option(None, help="window of sliding layers", parse=int)
    seed: int | None = option(None, help="init seed (= seed; default 0)", parse=int)
    dtype: str = option("bfloat16", help=None, choices=["bfloat16", "float32", "float16"])
    overwrite: bool = option(False, help="accepted for older scripts: a drafter export at --out is replaced "
                                         "anyway, anything else never is")
    overrides: list[str] = option(help="any TrainConfig field (train/config.py)", flag="overrides", nargs="*",
                                  metavar="key=value", default_factory=list)

    def train_config(self) -> TrainConfig:
        """The TrainConfig the drafter is built from: the recipe, the overrides, then the flags given (each flag
        names its TrainConfig field)."""
        flags = {"target": self.target, "num_hidden_layers": self.num_layers, "block_size": self.block_size,
                 "target_layer_ids": self.target_layer_ids, "mask_token_id": self.mask_token_id,
                 "sliding_window": self.sliding_window, "seed": self.seed}
        cfg = load_config(self.recipe, self.overrides, **{k: v for k, v in flags.items() if v is not None})
        if self.layer_types:
            cfg.layer_types = parse_layer_types(self.layer_types, cfg.num_hidden_layers)
        return cfg


def new_drafter(options: InitDrafterOptions):
    """`dflashkit init-drafter`: a new drafter built from ``options``' config, exported to ``options.out`` in
    ``options.dtype`` (``init_drafter``); returns (export path, DrafterConfig)."""
    return init_drafter(options.train_config(), options.out, dtype=getattr(torch, options.dtype),
                        overwrite=options.overwrite)


def build_parser() -> argparse.ArgumentParser:
    return options_parser(InitDrafterOptions, prog="dflashkit init-drafter", description=__doc__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``key=value`` overrides may come before, between or after the flags."""
    return build_parser().parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    out, dcfg = new_drafter(options_from(InitDrafterOptions, parse_args(argv)))
    summary = {k: v for k, v in dcfg.to_json_dict().items()
               if k in ("hidden_size", "num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id",
                        "layer_types", "sliding_window", "vocab_size")}
    print(f"wrote {out}\n{json.dumps(summary, indent=1)}")
    return 0


if __name__ == "__main__":
    import sys

    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit init-drafter", main))
