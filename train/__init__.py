"""Drafter training: anchors, packed block masks, block-prediction losses, the accelerate trainer, checkpoints.

    python -m dflashkit.train --recipe recipes/smollm2-135m.yaml shards=DIR     (see train/__main__.py)
    python -m dflashkit.train.export CKPT DIR

Heavy imports (accelerate, deepspeed, wandb, tensorboard) happen inside the functions that need them.
"""

from .anchors import anchor_candidates, eval_anchors, sample_anchors
from .block_mask import block_mask_mod, build_block_masks, dense_block_mask, flex_block_mask
from .config import TrainConfig
from .loss import block_loss
from .objectives import dpace_weights, loss_denominator, position_decay
from .recipe import load_config

__all__ = ["TrainConfig", "anchor_candidates", "block_loss", "block_mask_mod", "build_block_masks",
           "dense_block_mask", "dpace_weights", "eval_anchors", "flex_block_mask", "load_config",
           "loss_denominator", "position_decay", "sample_anchors"]

