"""One optimizer step: the forwards and backwards of the step's micro-batches, the optimizer and learning-rate
step, and the ranks' vote to stop, in the step's one collective.

Design choices:
- Normalisation is global: before a step's forwards, every rank adds up the loss denominators of its G
  micro-batches (known from the anchors alone) and these are summed across ranks. Each micro-batch then
  back-propagates ``loss_sum * W * G / global_denominator`` (accelerate divides by G, DDP/ZeRO average over W),
  so the update equals the single-process one on the same samples. A kind's extra term is normalised the same way
  by its own normaliser and weighed by its own weight (train/drafter_pass.py ``ExtraLossTerm``: DFlash2's
  selector term by the decay-weighted count of valid labels, or with ``selector_weights: loss`` the block loss's
  denominator, times ``selector_loss_weight``; DSpark's term, which replaces the block loss, by the
  decay-weighted count).
- The stop vote rides in the same collective as the denominators: every rank learns that some rank was
  signalled before any forward of the step, so all of them stop at the same step boundary and none waits in a
  collective that the others never reach.
- Divergence rides in it too: each step leaves, on the device, whether its loss or its gradient norm was NaN or
  Inf (no host sync); the next step's collective sums these flags over the ranks before any forward, so every
  rank learns of it at once and all stop together, before the diverged weights are used or saved. Checkpoints
  and the end of the run settle the last step's flags first (``check_finite``: one collective at a save, none per
  step). Without clipping (``max_grad_norm=0``, or DeepSpeed, which clips itself) only the loss is seen: a
  non-finite gradient shows as a non-finite loss one step later, or in the weights at the next save.
- The learning rate is a pure function of the step (train/setup.lr_at), set on the optimizer before the step:
  resuming needs only the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TrainConfig
from .data import PackedBlocks
from .drafter_pass import PassOptions, extra_term_of, forward_blocks
from .metrics import MetricSums
from .objectives import loss_denominator


class TrainingDiverged(RuntimeError):
    """A loss, gradient norm or weight became NaN or Inf: the run stops (exit 1), nothing of it is saved. Not a
    user error (the input was valid); its message names the step and the last finite checkpoint."""


NONFINITE_WHAT = ("the loss", "the gradient norm", "the weights")  # the flags' order, as messages name them


@dataclass
class StepResult:
    stopped: bool  # a rank asked to stop, or the previous step diverged: the step was not taken (no forward)
    grad_norm: torch.Tensor | None = None  # the clipped gradient's norm (None without clipping, or under DeepSpeed)
    nonfinite: torch.Tensor | None = None  # [2] on the device: this rank's loss, gradient norm was NaN/Inf (> 0)
    diverged: str | None = None  # what of the previous step was NaN/Inf on some rank (every rank agrees); None: fine


@dataclass(frozen=True)
class StepVotes:
    """What this rank brings to the step's one collective beside its loss denominators: its vote to stop, and the
    previous step's non-finite flags (its ``StepResult.nonfinite``; None for the run's first step)."""

    stop_requested: bool = False
    nonfinite: torch.Tensor | None = None


def nonfinite_names(flags: list[float]) -> str | None:
    """'the loss and the gradient norm' for flags [1, 1, 0] summed over ranks; None when all are 0."""
    names = [what for what, flag in zip(NONFINITE_WHAT, flags) if flag > 0]
    return None if not names else names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def set_lr(optimizer, peak_lr: float, factor: float) -> None:
    """Every group's lr = its peak (Muon's groups carry their own, ``base_lr``) times ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] = group.get("base_lr", peak_lr) * factor


def train_step(model, optimizer, accelerator, head, micro: list[PackedBlocks], *, cfg: TrainConfig, lr_factor: float,
               sums: MetricSums, pass_options: PassOptions, votes: StepVotes = StepVotes()) -> StepResult:
    """Take one optimizer step on this rank's ``micro`` (G micro-batches) unless some rank asked to stop or the
    previous step diverged (``votes``: this rank's stop request and the previous step's flags).

    ``pass_options``: the drafter pass's fixed arguments of the run (block layout, mask backend, the loss;
    train/drafter_pass.forward_blocks). The step's metrics are added to ``sums``.
    """
    world, G = accelerator.num_processes, cfg.grad_accum
    device = accelerator.device
    set_lr(optimizer, cfg.lr, lr_factor)
    loss_settings = pass_options.loss  # the run's objective (train/pass_options.py: cfg's loss and gamma)
    denoms = [loss_denominator(m.valid, loss_settings.variant, loss_settings.gamma) * m.scale for m in micro]
    # the kind's extra term has its own normaliser (DFlash2's selector: the decay-weighted count of valid labels,
    # or with selector_weights "loss" the block loss's; DSpark's: the decay-weighted count) and weight
    term = extra_term_of(model)
    term_denoms = [(term.normaliser(m.valid, cfg) if term is not None else torch.zeros((), device=m.valid.device))
                   * m.scale for m in micro]
    # one collective: the global loss denominators, the ranks' votes to stop and the previous step's non-finite
    # flags (all stop at the same step)
    previous = votes.nonfinite if votes.nonfinite is not None else torch.zeros(2, device=device)
    gathered = torch.cat([torch.stack([torch.stack(denoms).sum().float().to(device),
                                       torch.tensor(float(votes.stop_requested), device=device),
                                       torch.stack(term_denoms).sum().float().to(device)]), previous.float()])
    summed = accelerator.reduce(gathered, reduction="sum")
    global_denom, global_term_denom = summed[0], summed[2]
    stop_votes, *flags = summed[[1, 3, 4]].tolist()  # the step's one host sync
    diverged = nonfinite_names(flags)
    if diverged or stop_votes > 0:
        return StepResult(stopped=True, diverged=diverged)
    grad_norm = None
    bad = torch.zeros(2, device=device)  # this step's loss, gradient norm not finite: read by the next collective
    for m, d in zip(micro, denoms):
        with accelerator.accumulate(model):
            out = forward_blocks(model, head, m, pass_options)
            loss = out.loss_sum * (m.scale * world * G / global_denom.clamp_min(1e-12))
            if out.extra is not None:  # + the term's weight times the term (DFlash2), or the term alone (DSpark)
                part = out.extra.loss_sum * (term.weight(cfg) * m.scale * world * G
                                             / global_term_denom.clamp_min(1e-12))
                loss = part if term.replaces_block_loss else loss + part
            bad[0] += (~torch.isfinite(loss.detach())).float()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if cfg.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                if grad_norm is not None:  # the same on every rank: the gradients were reduced before clipping
                    bad[1] += (~torch.isfinite(torch.as_tensor(grad_norm, device=device))).float()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        sums.add(out, d, m.scale, m.num_tokens)
    return StepResult(stopped=False, grad_norm=grad_norm, nonfinite=bad)


def check_finite(model, accelerator, nonfinite: torch.Tensor | None) -> str | None:
    """Before a checkpoint, an eval or the export: what is NaN/Inf on some rank (every rank gets the same answer):
    the last step's loss or gradient norm (``nonfinite``, its ``StepResult.nonfinite``) or this rank's part of the
    weights; None when all are finite. One collective; collective, so every rank must call it."""
    device = accelerator.device
    params = [getattr(p, "ds_tensor", p).detach() for p in model.parameters()]  # ZeRO-3: this rank's partition
    checks = [(~torch.isfinite(p)).any() for p in params if p.numel()]
    weights_bad = torch.stack(checks).any().float() if checks else torch.zeros((), device=device)
    previous = nonfinite if nonfinite is not None else torch.zeros(2, device=device)
    flags = torch.cat([previous.float().to(device), weights_bad.reshape(1).to(device)])
    return nonfinite_names(accelerator.reduce(flags, reduction="sum").tolist())
