"""`dflashkit init-drafter`: write a randomly initialised drafter export for a target.

Lets a user see and check the config (taps, block size, mask token, layer layout) before any training, and
gives tests and benchmarks a drafter in the exact export format.

    dflashkit init-drafter --target testbed:smollm2 --out runs/drafter0 --num-layers 3 --block-size 16
    python -m dflashkit.train.init_drafter --target /models/Qwen3-8B --out drafter0 --target-layer-ids 1 9 17 25 33
"""

from __future__ import annotations

import argparse
import json

import torch

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.drafter.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_HIDDEN_LAYERS
from dflashkit.target.loading import load_target_head, resolve_mask_token_id


def parse_layer_types(text: str | None, num_layers: int) -> list[str] | None:
    """'full' / 'sliding' / a comma list like 'sliding,sliding,full' -> layer_types."""
    if not text:
        return None
    names = {"full": "full_attention", "sliding": "sliding_attention",
             "full_attention": "full_attention", "sliding_attention": "sliding_attention"}
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in names]
    if bad:
        raise SystemExit(f"--layer-types: unknown {bad}; use full, sliding or a comma list of them")
    if len(parts) == 1:
        parts = parts * num_layers
    if len(parts) != num_layers:
        raise SystemExit(f"--layer-types has {len(parts)} entries for --num-layers {num_layers}")
    return [names[p] for p in parts]


def drafter_config_for(target: str, num_layers: int = DEFAULT_NUM_HIDDEN_LAYERS, block_size: int = DEFAULT_BLOCK_SIZE,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       layer_types: list[str] | None = None, sliding_window: int | None = None,
                       trust_remote_code: bool = False) -> DrafterConfig:
    """A DrafterConfig sized for `target`, with the mask token resolved as DESIGN.md says."""
    from transformers import AutoTokenizer

    head = load_target_head(target, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(head.model_dir, trust_remote_code=trust_remote_code)
    mask = resolve_mask_token_id(tokenizer, head.config, mask_token_id)
    return DrafterConfig.for_target(head.config, num_hidden_layers=num_layers, block_size=block_size,
                                    target_layer_ids=target_layer_ids, mask_token_id=mask, layer_types=layer_types,
                                    sliding_window=sliding_window, input_embedding_scale=head.embedding_scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflashkit init-drafter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF model dir, .gguf file or testbed:smollm2")
    ap.add_argument("--out", required=True, help="export directory to write")
    ap.add_argument("--num-layers", type=int, default=DEFAULT_NUM_HIDDEN_LAYERS,
                    help=f"drafter decoder layers (default {DEFAULT_NUM_HIDDEN_LAYERS})")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                    help=f"tokens per block (default {DEFAULT_BLOCK_SIZE})")
    ap.add_argument("--target-layer-ids", type=int, nargs="+", help="decoder layers to tap (default: evenly spaced)")
    ap.add_argument("--mask-token-id", type=int, help="MASK id (default: tokenizer's mask token or a spare row)")
    ap.add_argument("--layer-types", help="full, sliding, or a comma list per layer (default full)")
    ap.add_argument("--sliding-window", type=int, help="window of sliding layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = drafter_config_for(args.target, args.num_layers, args.block_size, args.target_layer_ids,
                             args.mask_token_id, parse_layer_types(args.layer_types, args.num_layers),
                             args.sliding_window, args.trust_remote_code)
    out = save_drafter(build_drafter(cfg), args.out, dtype=getattr(torch, args.dtype))
    summary = {k: v for k, v in cfg.to_json_dict().items()
               if k in ("hidden_size", "num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id",
                        "layer_types", "sliding_window", "vocab_size")}
    print(f"wrote {out}\n{json.dumps(summary, indent=1)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
