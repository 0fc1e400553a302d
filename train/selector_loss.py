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
- with ``selector_missing_label: inject`` (training only; speculators' form) such a label takes the slot of the
  lowest candidate, with its own logit (``inject_missing_labels``), so every valid position has a term: the
  codebooks learn its pair term too and, with the unary coupling, the drafter's logit of the label rises against
  its top_k. Recall and accuracy still count it as not found (``injected``), as decoding would;
- positions are weighted with the ``ce`` decay exp(-(k-1)/gamma) (an early miss ends the block), and the sum is
  divided by the decay-weighted count of valid labels of the whole step, a denominator known from the anchors
  before any forward (as the block loss's), so accumulation and data parallelism give the single-process
  gradient. With ``selector_weights: loss`` they take the block loss's own weights instead (the loss pass's
  ``position_weights``: D-PACE's with the recipe, each position's share of the acceptance it can still add)
  and the block loss's normaliser (with D-PACE the blocks with a valid label), as SpecForge and NeMo
  Automodel's later trainer weigh the selector;
- the candidates and their unary logits come from the block loss's own lm_head pass (train/loss.py ``top_k``; no
  second lm_head pass for them). By default the unary logits carry no gradient: the term's gradient reaches the
  codebooks, the hidden projection and, through it, the drafter's layers (``selector_hidden_grad: false`` stops it
  at the projection: the pairwise term reads the states detached). With ``selector_unary_grad: true``
  (``candidate_logits``) it also reaches the drafter's final states through the unary logits themselves, as in
  every public DFlash2 trainer (NeMo Automodel, SpecForge, speculators): the 16-way choice then trains the
  drafter's own logits too, position 1's first of all. Its backward adds up the frozen lm_head's rows of each
  position's candidates weighted by their gradients (an ``embedding_bag``), so no [blocks, B-1, top_k, H] tensor
  is built.

This is the objective of NeMo Automodel's DFlash2 trainer (nemo_automodel/components/speculative/dflash/
dflash2_core.py: teacher-forced predecessor, CE over the top_k, absent labels excluded), except for the
step-level normaliser and, by default, the detached unary term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .objectives import position_decay


@dataclass
class SelectorLossOutput:
    loss_sum: torch.Tensor  # decay-weighted selector CE over valid labels among the candidates (differentiable)
    in_candidates: torch.Tensor  # valid labels found among the top_k candidates
    correct: torch.Tensor  # valid labels the teacher-forced selector chose (argmax of its scores)
    counted: torch.Tensor  # valid labels
    weight_sum: torch.Tensor  # decay-weighted count of valid labels: this pass's share of the step's normaliser
    # [N] per block, the leading run of positions whose label the teacher-forced selector chose: the accepted run
    # of the selector's greedy path (up to its first miss every predecessor it saw is the true token)
    runs: torch.Tensor | None = None

    def metric_sums(self) -> list[torch.Tensor]:
        """What the metric sums add (train/metrics.py; train/drafter_pass.py ``selector_metrics`` divides)."""
        return [self.loss_sum.detach(), self.weight_sum, self.in_candidates, self.correct, self.counted]


class _CandidateLogits(torch.autograd.Function):
    """The block loss's top_k logits as a function of the draft states: the forward hands back the values the
    loss pass computed; the backward is that of ``hidden @ weight[ids].T`` (the lm_head frozen, its bias a
    constant): each position's gradient is the sum of its candidates' lm_head rows weighted by their gradients."""

    @staticmethod
    def forward(ctx, hidden, logits, ids, weight):
        ctx.save_for_backward(ids, weight)
        ctx.hidden_dtype = hidden.dtype
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors
        k = ids.shape[-1]
        summed = F.embedding_bag(ids.reshape(-1, k), weight, per_sample_weights=grad.reshape(-1, k).to(weight.dtype),
                                 mode="sum")
        return summed.view(*ids.shape[:-1], -1).to(ctx.hidden_dtype), None, None, None


def candidate_logits(hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., top_k] (the loss pass's, no gradient) with the gradient of ``hidden @ weight[ids].T`` to
    ``hidden`` [..., H]: the unary term of ``selector_unary_grad`` (module notes)."""
    return _CandidateLogits.apply(hidden, logits.detach(), ids, weight.detach())


@torch.no_grad()
def inject_missing_labels(hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                          valid: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The candidates (``logits``, ``ids`` [N, P, top_k]) with each valid label that is not among them put in the
    slot of the lowest candidate, with its logit computed as the loss pass computes logits (the states and the
    lm_head row in the lm_head's dtype, the bias added, rounded to that dtype once; the sum's order may differ
    from the pass's matmul in the last bit); returns (logits, ids, injected [N, P]). hidden [N, P, H],
    labels / valid [N, P]."""
    injected = valid & ~(ids == labels.unsqueeze(-1)).any(-1)
    rows = F.embedding(labels, weight)  # [N, P, H] the labels' lm_head rows
    x, r = hidden.to(weight.dtype).reshape(-1, 1, hidden.shape[-1]), rows.reshape(-1, rows.shape[-1], 1)
    if bias is None:
        label_logit = torch.bmm(x, r).view(labels.shape)
    else:  # the bias added before the one rounding, as F.linear adds it
        label_logit = torch.baddbmm(bias[labels].reshape(-1, 1, 1), x, r).view(labels.shape)
    slot = F.one_hot(logits.argmin(-1), ids.shape[-1]).bool() & injected.unsqueeze(-1)
    return (torch.where(slot, label_logit.to(logits.dtype).unsqueeze(-1), logits),
            torch.where(slot, labels.unsqueeze(-1), ids), injected)


def predecessor_ids(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each draft position, [N, B-1]: the anchor token (block_ids [1, N*B] or [N, B]), then
    labels[:, :-1] (labels[:, k] is token a+k+1; wherever position k+1 is valid, a+k+1 lies in the sequence)."""
    n = labels.shape[0]
    return torch.cat([block_ids.reshape(n, -1)[:, :1], labels[:, :-1]], dim=1)


def selector_loss(scores: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                  gamma: float, weights: torch.Tensor | None = None,
                  weight_sum: torch.Tensor | None = None, injected: torch.Tensor | None = None) -> SelectorLossOutput:
    """scores / candidates [N, B-1, top_k]; labels (long) / valid (bool) [N, B-1]; ``weights`` [N, B-1] and
    ``weight_sum`` (this pass's share of the normaliser): the positions' weights in place of the decay's
    (``selector_weights: loss``, module notes); ``injected`` [N, B-1]: the labels ``inject_missing_labels`` put
    among the candidates, which have a term but count as not found and not chosen."""
    if (weights is None) != (weight_sum is None):
        raise ValueError("selector_loss: give the position weights and their normaliser together")
    hit = candidates == labels.unsqueeze(-1)
    counted = valid & hit.any(-1)
    slot = hit.to(torch.int64).argmax(-1)
    ce = F.cross_entropy(scores.float().reshape(-1, scores.shape[-1]), slot.reshape(-1),
                         reduction="none").view_as(slot)
    decay = position_decay(labels.shape[1] + 1, gamma, scores.device)
    loss_sum = (ce * (decay if weights is None else weights.detach().to(ce.dtype)) * counted).sum()
    with torch.no_grad():
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        found = valid if injected is None else valid & ~injected
        chose_label = (chosen == labels) & found
        correct = chose_label.sum()
        in_candidates = (counted if injected is None else counted & ~injected).sum()
        runs = torch.cumprod(chose_label.to(torch.int32), dim=-1).sum(-1)
    return SelectorLossOutput(loss_sum=loss_sum, in_candidates=in_candidates, correct=correct, counted=valid.sum(),
                              weight_sum=(decay * valid).sum() if weight_sum is None else weight_sum, runs=runs)
