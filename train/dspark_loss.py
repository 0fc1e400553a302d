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

``dspark_loss_sums`` returns the weighted sums of one micro-batch over materialised logits (the reference of the
tests); ``dspark_loss`` is the one-batch mean. The trainer's term (``dspark_term``, the kind's ``loss_term``
"dspark", train/drafter_pass.py) computes the same sums from the drafter's final states, a chunk of blocks at a
time (``chunk_tokens`` rows): each chunk's logits, the target's and the distributions live only inside that
chunk's call, which is checkpointed (recomputed in the backward), so memory holds one chunk's [rows, V] tensors,
not [n, P, V] (at a 150k vocabulary, a few GB per 2,048 rows instead of tens). The step adds the sums over its
micro-batches and ranks and divides by the summed decay-weighted count of valid labels (``loss_denominator``).
The term replaces the block loss (the paper's objective alone); the block loss's pass still runs, without a
gradient, for the backbone's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflashkit.drafter.kinds.dspark import DSparkLossOptions
from dflashkit.errors import UserError

from .objectives import loss_denominator, position_decay

__all__ = ["DSparkLossOptions", "DSparkLossSums", "DSparkTermOutput", "acceptance_rate", "dspark_forward_inputs",
           "dspark_loss", "dspark_loss_sums", "dspark_term", "teacher_forced_predecessors"]


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


# --------------------------------------------------------------------------- the trainer's term
@dataclass
class DSparkTermOutput:
    """DSpark's term of one micro-batch (sums over its valid labels, weighted by the decay)."""

    loss_sum: torch.Tensor  # alpha_ce * CE + alpha_tv * L1 + alpha_conf * BCE, summed (differentiable)
    ce: torch.Tensor  # the three weighted sums, detached (for the log)
    l1: torch.Tensor
    confidence: torch.Tensor
    correct: torch.Tensor  # valid labels the teacher-forced Markov argmax chose
    counted: torch.Tensor  # valid labels
    weight_sum: torch.Tensor  # decay-weighted count of valid labels: this pass's share of the step's normaliser
    # [N] per block, the leading run of positions whose label the teacher-forced Markov argmax chose: the accepted
    # run of the greedy Markov draft (up to its first miss, every predecessor it used is the true token)
    runs: torch.Tensor

    def metric_sums(self) -> list[torch.Tensor]:
        """What the metric sums add (train/metrics.py; ``metrics`` divides them)."""
        return [self.loss_sum.detach(), self.weight_sum, self.ce, self.l1, self.confidence, self.correct,
                self.counted]


def dspark_metrics(sums: list[float], prefix: str) -> dict:
    """The logged metrics from the added ``metric_sums``: the term and its parts per weighted label, and the
    teacher-forced Markov accuracy."""
    loss, weight, ce, l1, confidence, correct, counted = sums
    if not counted:
        return {}
    out = {f"{prefix}/dspark_loss": loss / weight, f"{prefix}/dspark_ce": ce / weight,
           f"{prefix}/dspark_acc": correct / counted}
    if l1 or confidence:  # held-out passes compute the CE part alone (DSparkLossOptions.evaluation)
        out.update({f"{prefix}/dspark_l1": l1 / weight, f"{prefix}/dspark_confidence": confidence / weight})
    return out


def _chunk_sums(draft, prev, teacher, labels, valid, model, weight, bias, options: DSparkLossOptions):
    """One chunk's sums [5] (ce, l1, confidence: weighted; correct, counted) and its blocks' leading runs [n]:
    draft/teacher [n, P, H], prev/labels/valid [n, P]."""
    logits = F.linear(draft.to(weight.dtype), weight, bias).float() + model.markov_head(prev).float()
    target = None
    if options.needs_target:
        with torch.no_grad():
            target = F.linear(teacher.to(weight.dtype), weight, bias).float()
    heads_dtype = model.markov_head.markov_w1.weight.dtype  # the states in the heads' dtype (autocast is off)
    confidence = model.confidence_logits(draft.to(heads_dtype), prev) if options.confidence_weight > 0 else None
    sums = dspark_loss_sums(logits, labels, valid, options, target, confidence)
    hit = (logits.detach().argmax(-1) == labels) & valid
    runs = hit.float().cumprod(-1).sum(-1)
    return torch.stack([*sums, hit.sum().float(), valid.sum().float()]), runs


def dspark_term(hidden: torch.Tensor, model, *, head, labels: torch.Tensor, valid: torch.Tensor,
                prev: torch.Tensor, teacher: torch.Tensor | None, options: DSparkLossOptions,
                chunk_tokens: int = 2048, grad: bool = True) -> DSparkTermOutput:
    """The term from the forward's final states hidden [1, N*B, H] (module docstring), inside the forward
    (``DSparkDraftModel.forward``'s ``dspark_targets``); ``teacher`` [N, B-1, H]: the target's final states
    predicting each label (its lm_head gives p_target); ``grad=False``: no gradient (held-out passes)."""
    n, p = labels.shape
    draft = hidden.view(n, p + 1, -1)[:, 1:]
    weight, bias = head.lm_head.weight.detach(), None if head.lm_head.bias is None else head.lm_head.bias.detach()
    chunk = max(1, int(chunk_tokens) // max(1, p))
    totals, runs = [], []
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, n, chunk):
            args = (draft[s:s + chunk] if grad else draft[s:s + chunk].detach(), prev[s:s + chunk],
                    None if teacher is None else teacher[s:s + chunk], labels[s:s + chunk], valid[s:s + chunk])
            if grad and torch.is_grad_enabled():
                sums, run = checkpoint(_chunk_sums, *args, model, weight, bias, options, use_reentrant=False)
            else:
                sums, run = _chunk_sums(*args, model, weight, bias, options)
            totals.append(sums)
            runs.append(run)
    total = torch.stack(totals).sum(0) if totals else draft.new_zeros(5, dtype=torch.float32)
    ce, l1, confidence, correct, counted = total.unbind()
    loss_sum = DSparkLossSums(ce, l1, confidence).combined(options)
    return DSparkTermOutput(loss_sum, ce.detach(), l1.detach(), confidence.detach(), correct.detach(),
                            counted.detach(), loss_denominator(valid, "ce", options.gamma),
                            torch.cat(runs) if runs else draft.new_zeros(0))


def dspark_forward_inputs(batch, labels: torch.Tensor, loss_pass) -> dict:
    """What the DSpark forward needs for its term: the true token before each draft position (the anchor, then
    the labels), the target's final states predicting each label, the lm_head and the chunking of the pass."""
    options = loss_pass.options
    if options.needs_target and batch.last_hidden is None:
        raise UserError("drafter_architecture=dspark trains on the target's distribution (its L1 and confidence "
                        "terms) and needs its last_hidden in every micro-batch; extract the shards with "
                        "--store-last-hidden, or train online (--target T --data FILE)")
    n = labels.shape[0]
    prev = teacher_forced_predecessors(batch.block_ids.reshape(n, -1)[:, 0], labels)
    teacher = batch.last_hidden[batch.teacher_index] if options.needs_target else None
    term = dict(head=loss_pass.head, labels=labels, valid=loss_pass.valid, prev=prev, teacher=teacher,
                options=options, chunk_tokens=loss_pass.loss.chunk_tokens,
                grad=loss_pass.loss_grad or loss_pass.term_grad)
    return {"dspark_targets": {"term": partial(dspark_term, **term)}}
