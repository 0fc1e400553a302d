"""One optimizer step: the forwards and backwards of the step's micro-batches, the optimizer and learning-rate
step, and the ranks' vote to stop, in the step's one collective.

Design choices:
- Normalisation is global: before a step's forwards, every rank adds up the loss denominators of its G
  micro-batches (known from the anchors alone) and these are summed across ranks. Each micro-batch then
  back-propagates ``loss_sum * W * G / global_denominator`` (accelerate divides by G, DDP/ZeRO average over W),
  so the update equals the single-process one on the same samples. DFlash2's selector term is normalised the
  same way by the decay-weighted count of valid labels (train/selector_loss.py).
- The stop vote rides in the same collective as the denominators: every rank learns that some rank was
  signalled before any forward of the step, so all of them stop at the same step boundary and none waits in a
  collective that the others never reach.
- The learning rate is a pure function of the step (train/setup.lr_at), set on the optimizer before the step:
  resuming needs only the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TrainConfig
from .data import PackedBlocks
from .drafter_pass import forward_blocks
from .loss import loss_denominator
from .metrics import MetricSums


@dataclass
class StepResult:
    stopped: bool  # a rank asked to stop: the step was not taken (no forward, no update)
    grad_norm: torch.Tensor | None = None  # the clipped gradient's norm (None without clipping, or under DeepSpeed)


def set_lr(optimizer, peak_lr: float, factor: float) -> None:
    """Every group's lr = its peak (Muon's groups carry their own, ``base_lr``) times ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] = group.get("base_lr", peak_lr) * factor


def train_step(model, optimizer, accelerator, head, micro: list[PackedBlocks], *, cfg: TrainConfig, lr_factor: float,
               stop_requested: bool, sums: MetricSums, pass_options: dict) -> StepResult:
    """Take one optimizer step on this rank's ``micro`` (G micro-batches) unless some rank asked to stop.

    ``pass_options``: the drafter pass's fixed arguments (block layout, mask backend, loss chunking;
    train/drafter_pass.forward_blocks). The step's metrics are added to ``sums``.
    """
    world, G = accelerator.num_processes, cfg.grad_accum
    device = accelerator.device
    set_lr(optimizer, cfg.lr, lr_factor)
    denoms = [loss_denominator(m.valid, cfg.loss, cfg.gamma) * m.scale for m in micro]
    # DFlash2's selector term is normalised by the decay-weighted count of valid labels (selector_loss.py)
    sel_denoms = [loss_denominator(m.valid, "ce", cfg.gamma) * m.scale for m in micro]
    # one collective: the global loss denominators and the ranks' votes to stop (all stop at the same step)
    votes = torch.stack([torch.stack(denoms).sum().float().to(device),
                         torch.tensor(float(stop_requested), device=device),
                         torch.stack(sel_denoms).sum().float().to(device)])
    global_denom, stop_votes, global_sel_denom = accelerator.reduce(votes, reduction="sum")
    if stop_votes > 0:
        return StepResult(stopped=True)
    grad_norm = None
    for m, d in zip(micro, denoms):
        with accelerator.accumulate(model):
            out = forward_blocks(model, head, m, variant=cfg.loss, gamma=cfg.gamma, dpace_alpha=cfg.dpace_alpha,
                                 kl_weight=cfg.kl_weight, labels=cfg.labels, **pass_options)
            loss = out.loss_sum * (m.scale * world * G / global_denom.clamp_min(1e-12))
            if out.selector is not None:  # DFlash2: + selector_loss_weight * the selector term
                loss = loss + out.selector.loss_sum * (cfg.selector_loss_weight * m.scale * world * G
                                                       / global_sel_denom.clamp_min(1e-12))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if cfg.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        sums.add(out, d, m.scale, m.num_tokens)
    return StepResult(stopped=False, grad_norm=grad_norm)
