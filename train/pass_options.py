"""The drafter pass's fixed arguments of a run (train/drafter_pass.forward_blocks), and what the drafter kind's
extra loss term asks of the run: its weight and whether it reads the target's final hidden states."""

from __future__ import annotations

import torch

from dflashkit.drafter.kinds import kind_for

from .config import TrainConfig
from .drafter_pass import EXTRA_LOSS_TERMS, PassOptions, mask_backend
from .loss import LossSettings


def drafter_pass_options(cfg: TrainConfig, dcfg, device: torch.device) -> PassOptions:
    """The drafter pass's fixed arguments of a run (train/drafter_pass.forward_blocks): the drafter's block layout,
    the mask backend for ``device``, the loss (its objective, chunking, and the compiled logit kernels with
    compiled layers on CUDA), the labels, whether the kind's extra term (DFlash2's selector term) is computed and
    its options from the run's settings (drafter/kinds/)."""
    loss = LossSettings(cfg.loss, cfg.gamma, cfg.dpace_alpha, cfg.kl_weight, cfg.loss_chunk_tokens,
                        fused=cfg.compile and device.type == "cuda")
    return PassOptions(dcfg.block_size, dcfg.layer_types, dcfg.sliding_window, mask_backend(cfg.attention, device),
                       dcfg.causal, loss, cfg.labels, extra_term=extra_term_weight(cfg, dcfg.architecture) > 0,
                       term_options=kind_for(dcfg.architecture).options_from(cfg))


def extra_term_weight(cfg: TrainConfig, architecture: str) -> float:
    """The weight of the kind's extra term in this run's steps (0 for a kind without one)."""
    name = kind_for(architecture).loss_term
    return 0.0 if name is None else EXTRA_LOSS_TERMS[name].weight(cfg)


def term_reads_last_hidden(cfg: TrainConfig, architecture: str) -> bool:
    """Whether the kind's extra term reads the target's final hidden states (DSpark's L1 and confidence terms)."""
    kind = kind_for(architecture)
    return kind.loss_term is not None and extra_term_weight(cfg, architecture) > 0 and \
        EXTRA_LOSS_TERMS[kind.loss_term].needs_last_hidden(kind.options_from(cfg))
