"""The DFlash2 candidate selector's training term, added to the block loss with weight ``selector_loss_weight``.

At decoding time the selector walks a block's draft positions left to right and, at position k, chooses among
the drafter's top_k candidates by ``score = logit + <A[prev] * W h_k, B[cand]>``, prev being the token it chose at
k - 1 (the anchor token at k = 1). Training teacher-forces that walk:

- prev is the true token a+k-1 (the anchor at k = 1): the token the walk has committed whenever the target
  accepts up to k - 1, the only case in which position k's choice matters to the acceptance length;
- the term is the cross-entropy of the softmax over the top_k scores against the slot of the true token a+k;
- a position whose true token is not among the candidates carries no selector term: no choice of the selector
  can be right there, and the block loss, not the selector, has to bring the token into the candidates. The
  fraction of labels among the candidates (``selector_recall``) is logged: it bounds what the selector can do;
- positions are weighted with the ``ce`` decay exp(-(k-1)/gamma) (an early miss ends the block), and the sum is
  divided by the decay-weighted count of valid labels of the whole step, a denominator known from the anchors
  before any forward (as the block loss's), so accumulation and data parallelism give the single-process
  gradient;
- the candidates and their unary logits come without a gradient (drafter/modeling_dflash2.selector_scores),
  from the block loss's own lm_head pass (train/loss.py ``top_k``; no second lm_head pass for them): the block
  loss already trains the logits, and a gradient through the unary term would need the lm_head rows of every
  candidate ([blocks, B-1, top_k, H]). The gradient reaches the codebooks, the hidden projection and,
  through it, the drafter's layers.

This is the objective of NeMo Automodel's DFlash2 trainer (nemo_automodel/components/speculative/dflash/
dflash2_core.py: teacher-forced predecessor, CE over the top_k, absent labels excluded), except for the
detached unary term and the step-level normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .loss import position_decay


@dataclass
class SelectorLossOutput:
    loss_sum: torch.Tensor  # decay-weighted selector CE over valid labels among the candidates (differentiable)
    in_candidates: torch.Tensor  # valid labels found among the top_k candidates
    correct: torch.Tensor  # valid labels the teacher-forced selector chose (argmax of its scores)
    counted: torch.Tensor  # valid labels
    weight_sum: torch.Tensor  # decay-weighted count of valid labels: this pass's share of the step's normaliser


def predecessor_ids(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each draft position, [N, B-1]: the anchor token (block_ids [1, N*B] or [N, B]), then
    labels[:, :-1] (labels[:, k] is token a+k+1; wherever position k+1 is valid, a+k+1 lies in the sequence)."""
    n = labels.shape[0]
    return torch.cat([block_ids.reshape(n, -1)[:, :1], labels[:, :-1]], dim=1)


def selector_loss(scores: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                  gamma: float) -> SelectorLossOutput:
    """scores / candidates [N, B-1, top_k]; labels (long) / valid (bool) [N, B-1]."""
    hit = candidates == labels.unsqueeze(-1)
    counted = valid & hit.any(-1)
    slot = hit.to(torch.int64).argmax(-1)
    ce = F.cross_entropy(scores.float().reshape(-1, scores.shape[-1]), slot.reshape(-1),
                         reduction="none").view_as(slot)
    decay = position_decay(labels.shape[1] + 1, gamma, scores.device)
    loss_sum = (ce * decay * counted).sum()
    with torch.no_grad():
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        correct = ((chosen == labels) & valid).sum()
    return SelectorLossOutput(loss_sum=loss_sum, in_candidates=counted.sum(), correct=correct, counted=valid.sum(),
                              weight_sum=(decay * valid).sum())
