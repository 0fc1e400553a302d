"""The block loss's three objectives: each position's weight and the normaliser (the engine that computes the
loss through the lm_head is train/loss.py).

Draft position k (1..B-1) of the block anchored at a predicts token a+k. A label is valid when a+k < L and
loss_mask[a+k] holds. Three objectives, chosen by one flag (``variant``):

- ``ce`` (the public DFlash recipe): sum_k w_k * CE_k with w_k = exp(-(k-1)/gamma) on valid labels,
  normalised by the sum of those weights. Early positions count more: a miss there discards the rest.
- ``dpace`` (D-PACE, "Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting",
  arXiv:2605.18810): the fixed decay is replaced by detached weights from the drafter's own confidence
  q_k = exp(-CE_k) on the label. Smoothed q~_k = (1 - alpha) q_k + alpha (paper Eq. 7, alpha = 0.5);
  w_j = sum_{m >= j, valid} prod_{i <= m} q~_i (Eq. 8), i.e. the expected accepted length credited to j;
  loss = sum_j w_j CE_j (Eq. 9). Invalid labels get q~ = 1 (they neither break nor earn credit). Normalised by
  the number of blocks with at least one valid label, as the paper's author asked in sgl-project/SpecForge
  issue #828 (dividing by sum(w) would cancel the credit mass).
- ``kl``: soft labels. The target's distribution for token a+k is lm_head(last_hidden[a+k-1]), where
  ``last_hidden`` is the target's final-norm output that extraction stores (targets/capture.py), so only the
  lm_head is applied here. Per position
  (1 - kl_weight) * CE_k + kl_weight * KL(p_target || q_draft), with the ``ce`` decay weights and normaliser.

An objective is a small ``Objective``: its per-position weights (``ce_weights``, ``dpace_weights``; detached) and
the share ``soft`` of its term on the teacher (``kl_weight`` for kl, 0 otherwise). ``loss_denominator`` is its
normaliser, summed by the trainer over the micro-batches of a step and over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VARIANTS = ("ce", "dpace", "kl")


def position_decay(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..B-1 ([B-1], computed in fp64)."""
    k = torch.arange(1, block_size, dtype=torch.float64, device=device)
    return torch.exp(-(k - 1) / float(gamma)).to(dtype)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (detached). ce, valid: [N, P] -> [N, P] (zero on invalid labels)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1], got {alpha}")
    valid = valid.to(ce.dtype)
    q = torch.exp(-ce.detach())
    q_smooth = torch.where(valid > 0, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(q_smooth, dim=-1)
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * valid, [-1]), dim=-1), [-1])
    return suffix * valid


def loss_denominator(valid: torch.Tensor, variant: str, gamma: float) -> torch.Tensor:
    """The normaliser contributed by one micro-batch (valid: [N, B-1]); summed over the step and ranks."""
    if variant == "dpace":
        return valid.any(dim=-1).sum().to(torch.float32)
    decay = position_decay(valid.shape[-1] + 1, gamma, valid.device)
    return (valid.to(torch.float32) * decay).sum()


@dataclass(frozen=True)
class Objective:
    """What one objective asks of the engine: the weight of each position (detached) and the share ``soft`` of
    its per-position term on the teacher's distribution: term = (1 - soft) * CE + soft * KL(p_target || q)."""

    weights: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (ce, valid, decay) -> [n, P]
    soft: float = 0.0  # 0 for hard labels (ce, dpace); kl_weight for kl


def ce_weights(ce: torch.Tensor, valid: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    return decay * valid  # the fixed decay exp(-(k-1)/gamma) on valid labels (ce and kl)


def objective(variant: str, dpace_alpha: float = 0.5, kl_weight: float = 0.5) -> Objective:
    """The objective named by ``variant`` (the module notes)."""
    if variant == "dpace":
        return Objective(lambda ce, valid, decay: dpace_weights(ce, valid, dpace_alpha))
    return Objective(ce_weights, soft=float(kl_weight) if variant == "kl" else 0.0)
