"""DSpark's training objective (arXiv 2607.05147 section 3.3; deepseek-ai/DeepSpec deepspec/modeling/dspark/
loss.py), as plain tensor functions over materialised logits.

Draft position k (1..P, P = B-1) of the block anchored at a predicts token a+k (the 1 + N layout of
drafter/modeling_dspark.py). Per position:
- the draft distribution p_d = softmax(U_k + B(x_{k-1})): the backbone's logits plus the Markov bias of the TRUE
  previous token (teacher forcing: the anchor for k = 1, label k-1 after it; ``teacher_forced_predecessors``);
- the target distribution p_t = softmax of the target's logits for token a+k (its lm_head on its last hidden
  state at a+k-1, as train/loss.py's ``kl`` objective takes it);
- ``ce_k`` = -log p_d(label_k) (paper eq. 9);
- ``l1_k`` = ||p_d - p_t||_1, twice the total variation distance (eq. 10; the reference's ``l1_loss``);
- ``c*_k`` = 1 - l1_k / 2, the probability that speculative sampling accepts draft k (eq. 8), detached;
- ``conf_k`` = BCE(sigmoid(confidence logit_k), c*_k), a soft label (eq. 11; binary_cross_entropy_with_logits).
Each is weighted by w_k = exp(-(k-1)/gamma) on valid labels (train/loss.py ``position_decay``) and normalised by
the sum of those weights, one denominator for the three as in the reference; the loss is
alpha_ce * CE + alpha_tv * L1 + alpha_conf * CONF with the paper's defaults 0.1, 0.9, 1.0 (eq. 12).

``dspark_loss_sums`` returns the weighted sums of one micro-batch (the trainer adds them over a step and its
ranks, then divides by the summed ``loss_denominator``); ``dspark_loss`` is the one-batch mean. Both hold full
[n, P, V] fp32 distributions: fine for tests and small vocabularies; a trainer at a 150k vocabulary needs them
chunked like train/loss.py's engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .loss import loss_denominator, position_decay


@dataclass(frozen=True)
class DSparkLossOptions:
    ce_weight: float = 0.1  # alpha_ce: cross-entropy on the label
    tv_weight: float = 0.9  # alpha_tv: ||p_draft - p_target||_1; > 0 needs the target's logits
    confidence_weight: float = 1.0  # alpha_conf: the confidence head's BCE; > 0 needs target logits and the head
    gamma: float = 7.0  # position decay exp(-(k-1)/gamma): DFlash's for block 16 (the reference uses 4 for block 7)

    def __post_init__(self):
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not self.gamma > 0:
            raise ValueError(f"gamma={self.gamma!r} must be > 0")


class DSparkLossSums(NamedTuple):
    """Weighted sums over one micro-batch's draft positions (each sum_k w_k * term_k over valid labels)."""
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor

    def combined(self, options: DSparkLossOptions) -> torch.Tensor:
        return (options.ce_weight * self.ce + options.tv_weight * self.l1
                + options.confidence_weight * self.confidence)


def teacher_forced_predecessors(anchor_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each draft position: the anchor, then labels 1..P-1; anchor_ids [n], labels [n, P] ->
    [n, P]. (An invalid label only feeds the position after it, which is invalid too once labels are a prefix.)"""
    return torch.cat([anchor_ids[:, None].to(labels.dtype), labels[:, :-1]], dim=1)


def acceptance_rate(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """1 - ||softmax(draft) - softmax(target)||_1 / 2 per position, in [0, 1]: [..., V] -> [...] (fp32)."""
    l1 = (draft_logits.float().softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


def dspark_loss_sums(draft_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                     options: DSparkLossOptions, target_logits: torch.Tensor | None = None,
                     confidence_logits: torch.Tensor | None = None) -> DSparkLossSums:
    """The three weighted sums of one micro-batch (module docstring). draft_logits [n, P, V] carry the Markov
    bias already (``DSparkDraftModel.block_logits`` with ``teacher_forced_predecessors``); labels, valid [n, P];
    target_logits [n, P, V] (needed when tv_weight or confidence_weight > 0); confidence_logits [n, P] (needed
    when confidence_weight > 0). A term whose weight is 0 is not computed (its sum is 0)."""
    n, p, vocab = draft_logits.shape
    if labels.shape != (n, p) or valid.shape != (n, p):
        raise ValueError(f"labels {tuple(labels.shape)} and valid {tuple(valid.shape)} must be {(n, p)}")
    needs_target = options.tv_weight > 0 or options.confidence_weight > 0
    if needs_target and (target_logits is None or target_logits.shape != draft_logits.shape):
        raise ValueError(f"tv_weight / confidence_weight > 0 need target_logits of shape {(n, p, vocab)}")
    if options.confidence_weight > 0 and (confidence_logits is None or confidence_logits.shape != (n, p)):
        raise ValueError(f"confidence_weight > 0 needs confidence_logits of shape {(n, p)}")
    weights = valid.to(torch.float32) * position_decay(p + 1, options.gamma, draft_logits.device)
    zero = draft_logits.new_zeros((), dtype=torch.float32)
    ce = F.cross_entropy(draft_logits.float().reshape(-1, vocab), labels.reshape(-1).long(), reduction="none")
    ce_sum = (ce.view(n, p) * weights).sum()
    l1_sum = conf_sum = zero
    if needs_target:
        l1 = (draft_logits.float().softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
        if options.tv_weight > 0:
            l1_sum = (l1 * weights).sum()
        if options.confidence_weight > 0:
            accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # the soft label c*_k
            bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
            conf_sum = (bce * weights).sum()
    return DSparkLossSums(ce_sum, l1_sum, conf_sum)


def dspark_loss(draft_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                options: DSparkLossOptions, target_logits: torch.Tensor | None = None,
                confidence_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, DSparkLossSums]:
    """The loss of one batch (its sums over its own denominator) and the per-term means (for logging)."""
    sums = dspark_loss_sums(draft_logits, labels, valid, options, target_logits, confidence_logits)
    denominator = loss_denominator(valid, "ce", options.gamma).clamp_min(1e-6)
    means = DSparkLossSums(*(s / denominator for s in sums))
    return means.combined(options), means
