"""Training setup, the drafter's part: the drafter (new, sized for the target, or the init_from one), its
optimizer (AdamW, or Muon on the 2-D matrices: train/muon.py) and parameter groups, DFlash2's convolution
kernels, the compiled layers and the drafter pass's fixed arguments, prepared by accelerate (train/setup.py
gathers them into the run).
"""

from __future__ import annotations

import os

import torch

from dflashkit.errors import UserError

from .config import TrainConfig
from .drafter_pass import compile_layers
from .pass_options import drafter_pass_options


def resolve_mask_token(cfg: TrainConfig, head) -> int:
    """cfg.mask_token_id, else the tokenizer's mask token or a spare row (the one resolver, targets/loading.py)."""
    from transformers import AutoTokenizer

    from dflashkit.targets.loading import resolve_mask_token_id

    tokenizer = None if cfg.mask_token_id is not None else AutoTokenizer.from_pretrained(head.model_dir)
    return resolve_mask_token_id(tokenizer, head.config, cfg.mask_token_id)


def build_model(cfg: TrainConfig, manifest: dict, head, init_model=None):
    """A new drafter sized for the target, or ``init_model``: the ``init_from`` drafter, loaded and checked against
    ``cfg`` before the target (train/run_dir.py); returns (model, DrafterConfig)."""
    from dflashkit.drafter import DrafterConfig, build_drafter

    if init_model is not None:
        return init_model.train(), init_model.dflash
    dcfg = DrafterConfig.for_target(
        head.config, num_hidden_layers=cfg.num_hidden_layers, block_size=cfg.block_size,
        target_layer_ids=list(cfg.target_layer_ids or manifest.get("target_layer_ids") or []),
        mask_token_id=resolve_mask_token(cfg, head), layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window, input_embedding_scale=float(head.embedding_scale),
        causal=cfg.causal, architecture=cfg.drafter_architecture, **cfg.drafter)
    return build_drafter(dcfg).train(), dcfg


def param_groups(model, weight_decay: float, lr: float | None = None, codebook_lr_scale: float = 1.0) -> list[dict]:
    """AdamW's groups: weight decay on every parameter but the norms and DFlash2's base kernels; DFlash2's
    codebooks in a group of their own at ``codebook_lr_scale`` times ``lr`` unless that is 1 (muon.codebook_group)."""
    decay, no_decay = [], []
    from .muon import codebook_group, never_decayed

    for name, p in model.named_parameters():
        if not p.requires_grad:  # a frozen part (DFlash2's selector when its term has weight 0)
            continue
        (no_decay if never_decayed(name, p) else decay).append(p)  # norms, DFlash2's base kernels
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return codebook_group(groups, model, lr, weight_decay, codebook_lr_scale)


def build_optimizer(cfg: TrainConfig, model, backend_name: str) -> torch.optim.Optimizer:
    """AdamW, or Muon on the 2-D matrices and AdamW on the rest (train/muon.py)."""
    if cfg.optimizer == "muon":
        from .muon import Muon, check_backend, muon_param_groups

        check_backend(backend_name)
        return Muon(muon_param_groups(model, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                      codebook_lr_scale=cfg.selector_codebook_lr_scale),
                    lr=cfg.lr, momentum=cfg.muon_momentum, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                    ns_dtype=cfg.muon_ns_dtype)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, cfg.lr, cfg.selector_codebook_lr_scale),
                             lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)


def conv_kernels(cfg: TrainConfig, model, device: torch.device, say=print) -> int:
    """With ``conv_kernel``, DFlash2's in-block convolutions by train/dynamic_conv.py's kernels where Triton runs
    on ``device`` (said either way); returns how many convolutions take them (0, unsaid, for a drafter without
    them)."""
    from .dynamic_conv import in_block_convolutions, install

    if not cfg.conv_kernel or not in_block_convolutions(model):
        return 0
    n = install(model, device)
    say(f"conv_kernel: {n} in-block convolutions by Triton kernels" if n else
        f"conv_kernel: Triton does not run on {device}; the convolutions stay the model's torch expression")
    return n


def check_compile_cache() -> None:
    """compile=true writes torch.compile's cache (inductor's: TORCHINDUCTOR_CACHE_DIR, by default
    /tmp/torchinductor_USER); one line before the first compile when it cannot be written there."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from dflashkit.outputs import check_writable

    try:  # the path inductor's cache_dir() takes, without making it
        check_writable(os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()),
                       "torch.compile's cache")
    except UserError as error:
        raise UserError(f"compile=true: {error} (TORCHINDUCTOR_CACHE_DIR sets the path), or set "
                        f"compile=false") from None


def prepare_drafter(cfg: TrainConfig, accelerator, model, dcfg, backend_name: str, selector: bool):
    """(model, optimizer, pass options): the optimizer built, both prepared by accelerate, the drafter's layers
    compiled when asked, and the drafter pass's fixed arguments (train/drafter_pass.forward_blocks)."""
    optimizer = build_optimizer(cfg, model, backend_name)
    model, optimizer = accelerator.prepare(model, optimizer)
    conv_kernels(cfg, accelerator.unwrap_model(model), accelerator.device, accelerator.print)
    if cfg.compile:  # per decoder layer, dynamic shapes from the start (train/drafter_pass.compile_layers)
        check_compile_cache()
        compile_layers(accelerator.unwrap_model(model))
    pass_options = drafter_pass_options(cfg, dcfg, accelerator.device)
    accelerator.print(f"attention mask: {pass_options.backend}{' (compiled drafter layers)' if cfg.compile else ''}")
    return model, optimizer, pass_options
