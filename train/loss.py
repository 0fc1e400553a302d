"""Block-prediction losses, computed in chunks through the target's lm_head.

Draft position k (1..B-1) of the block anchored at a predicts token a+k. Three objectives, chosen by one flag
(``variant``): ``ce``, ``dpace`` and ``kl``; train/objectives.py states each (its position weights and normaliser).

Design choices:
- One engine for the three (``chunked_logit_statistics``): it walks the blocks in chunks through the lm_head and
  computes from each chunk's logits what every objective needs: the logsumexp, the label's logit (so CE) and
  the argmax, and for ``kl`` the teacher's distribution over the same rows. An objective is then only a small
  ``Objective`` (train/objectives.py): its per-position weights (``ce_weights``, ``dpace_weights``) and the share
  ``soft`` of its term on the teacher (``kl_weight`` for kl, 0 otherwise); the gradient of every objective is
  ``w * (softmax - (1 - soft) * onehot(label) - soft * p_target)``.
- Never materialise [blocks*(B-1), vocab] fp32 logits: a custom autograd function runs the engine, which
  computes the loss and d(loss)/d(hidden) of each chunk at once (the lm_head is frozen, so no weight gradient),
  keeps only the [*, H] gradient and returns it in backward. Cost: one lm_head forward and one input-gradient
  matmul per token, no recomputation. Chunks hold whole blocks (D-PACE needs the block).
- The function returns the *un-normalised* weighted sum. The trainer divides by the global denominator
  (``loss_denominator`` summed over all micro-batches of the step and over all ranks), so gradient
  accumulation and data parallelism give exactly the single-process gradient.
- ``fused=True`` (CUDA training with ``compile``) is a backend of the same engine: its two logit functions
  (``_logit_stats``: logsumexp, label logit and argmax in one read of the lm_head's logits; ``_logit_grad``: the
  logit gradient in the lm_head's dtype) run compiled, so the upcast happens in registers (~10 bytes per logit
  against ~44 eager, where the loss is memory-bound on the vocabulary). ``kl`` stays eager (its teacher
  distribution is an fp32 [rows, vocab] tensor anyway). Eager is the reference and the CPU path; tests hold the
  fused one to it.
- Metrics come out of the same pass: per-position correct/valid counts and the tau_sim sum (1 + leading run of
  positions whose argmax equals the label; an invalid label ends the run) over the blocks that have at least
  one valid label (padding blocks of a packed micro-batch have none and count nowhere), and each block's run
  (held-out evaluation replays live decoding from them: train/evaluate.py). All of them stay on the device:
  nothing here waits for the GPU.
- ``top_k`` > 0 (a DFlash2 drafter's candidate selector, train/selector_loss.py): the same pass also keeps each
  position's top_k logits and their token ids (``torch.topk`` on each chunk's logits, in the lm_head's dtype,
  before they are freed; values then as float32), so the selector's candidates cost no second lm_head pass. It is
  one eager op after either backend's statistics; for an fp32 lm_head the candidates are exactly those of
  ``topk(logits.float())``, for bf16 the same values (the upcast is exact and keeps the order).
  That top_k is train/grouped_topk.py's ``grouped_topk``, which takes the group maxima the statistics already
  found (``_logit_stats_grouped``) and on a GPU runs one Triton kernel per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from dflashkit.errors import UserError

from .grouped_topk import TOPK_GROUP, grouped_topk, groups_pay
from .objectives import VARIANTS, Objective, objective, position_decay


@dataclass
class BlockLossOutput:
    loss_sum: torch.Tensor  # weighted loss summed over blocks (differentiable w.r.t. hidden); divide by the denominator
    ce_sum: torch.Tensor  # plain CE summed over valid labels (for logging)
    correct: torch.Tensor  # [B-1] valid labels whose argmax matched, per draft position
    counted: torch.Tensor  # [B-1] valid labels per draft position
    tau_sum: torch.Tensor  # sum over counted blocks of 1 + leading run of correct positions
    runs: torch.Tensor  # [N] per block, its leading run of correct positions (0 for blocks with no valid label)
    blocks: torch.Tensor  # counted blocks: those with at least one valid label
    top_logits: torch.Tensor | None = None  # [N, B-1, top_k] float32, no gradient: the top_k logits (top_k > 0)
    top_ids: torch.Tensor | None = None  # [N, B-1, top_k] long: their token ids, the selector's candidates
    # the drafter kind's extra term of the same pass (train/drafter_pass.py ExtraLossTerm: DFlash2's selector
    # term, train/selector_loss.py; DSpark's, train/dspark_loss.py), else None
    extra: object = None
    position_weights: torch.Tensor | None = None  # [N, B-1] the objective's weight of each position (top_k > 0)

    @property
    def selector(self):
        """DFlash2's name of ``extra``: its selector term."""
        return self.extra

    @selector.setter
    def selector(self, value) -> None:
        self.extra = value


@dataclass(frozen=True)
class LossSettings:
    """The block loss's settings of a run (built once, not per micro-batch): the objective, its parameters and how
    the engine walks the logits. Out-of-range values are refused when the settings are made."""

    variant: str = "ce"  # the objective: one of VARIANTS (the module notes)
    gamma: float = 7.0  # the position decay exp(-(k-1)/gamma) of ce and kl; D-PACE's normaliser ignores it
    dpace_alpha: float = 0.5  # D-PACE's smoothing of the drafter's confidence, in (0, 1]
    kl_weight: float = 0.5  # kl: the share of KL(p_target || q) in each position's term, in [0, 1]
    chunk_tokens: int = 2048  # rows of logits alive at once (rounded to whole blocks)
    fused: bool = False  # compiled logit kernels for ce and dpace (the module notes; kl always runs eager)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"loss variant must be one of {VARIANTS}, got {self.variant!r}")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise UserError(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.variant == "dpace" and not 0.0 < self.dpace_alpha <= 1.0:
            raise UserError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")

    @cached_property
    def objective(self) -> Objective:
        """The objective these settings name (made once: the settings are frozen)."""
        return objective(self.variant, float(self.dpace_alpha), float(self.kl_weight))

    @property
    def fused_kernels(self) -> bool:
        """Whether the engine runs the compiled kernels: asked for, and the objective has hard labels."""
        return bool(self.fused) and not self.objective.soft


# --------------------------------------------------------------------------- the engine and its two backends
def _logit_stats(logits: torch.Tensor, labels: torch.Tensor, acc: torch.dtype):
    """Per row: logsumexp, the label's logit and the argmax, reading the logits once (upcast in registers)."""
    x = logits.to(acc)
    return torch.logsumexp(x, dim=-1), x.gather(-1, labels.unsqueeze(-1)).squeeze(-1), x.argmax(-1)


def _logit_stats_grouped(logits: torch.Tensor, labels: torch.Tensor, acc: torch.dtype, group: int):
    """``_logit_stats`` plus each row's maximum per group of ``group`` columns (grouped_topk's first step), all
    from one read of the logits: per group its max, first argmax and sum of exp(x - max), then the row's
    logsumexp and argmax from those (an earlier index wins ties, as torch.argmax's); the tail columns past the
    last whole group are folded in apart. Returns (lse, label logit, argmax, group maxima [rows, groups])."""
    rows, cols = logits.shape
    n = cols // group
    body = n * group
    x = logits[:, :body].reshape(rows, n, group).to(acc)
    gmax, garg = x.max(dim=-1)
    gsum = torch.exp(x - gmax.unsqueeze(-1)).sum(-1)
    m, best = gmax.max(dim=-1)
    s = (gsum * torch.exp(gmax - m.unsqueeze(-1))).sum(-1)
    arg = best * group + garg.gather(-1, best.unsqueeze(-1)).squeeze(-1)
    if body < cols:
        t = logits[:, body:].to(acc)
        tmax, targ = t.max(dim=-1)
        top = torch.maximum(m, tmax)
        s = s * torch.exp(m - top) + torch.exp(t - top.unsqueeze(-1)).sum(-1)
        arg = torch.where(tmax > m, targ + body, arg)
        m = top
    tgt = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(acc)
    return m + torch.log(s), tgt, arg, gmax


def _logit_grad(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                hard: float = 1.0, teacher_p: torch.Tensor | None = None) -> torch.Tensor:
    """d(w * term)/d(logits) = w * (softmax - hard * onehot(label) - p_target) in the logits' dtype, where
    ``hard`` = 1 - soft and ``teacher_p`` is the teacher's distribution already times ``soft`` (kl only)."""
    x = logits.to(lse.dtype)
    onehot = torch.arange(x.shape[-1], device=x.device) == labels.unsqueeze(-1)
    g = torch.exp(x - lse.unsqueeze(-1)) - hard * onehot.to(x.dtype)
    if teacher_p is not None:
        g = g - teacher_p
    return (g * w.unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict = {}


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def logit_statistics(grouped: bool, fused: bool) -> Callable:
    """The loss pass's statistics of a chunk's logits: ``(logits, labels, acc)`` -> (lse, label logit, argmax),
    or with ``grouped`` ``(logits, labels, acc, group)`` -> the same and each group's maximum; compiled when
    ``fused``."""
    fn = _logit_stats_grouped if grouped else _logit_stats
    return _compiled(fn) if fused else fn


def chunked_logit_statistics(hidden, weight, bias, labels, valid, teacher, settings: LossSettings,
                             need_grad: bool, top_k: int = 0):
    """The engine: walk whole blocks, ``settings.chunk_tokens`` rows at a time, through the lm_head and compute,
    from each chunk's logits, what every objective needs (logsumexp, the label's logit, the argmax; the teacher's
    distribution when the objective is soft), then the weighted loss, the metrics and d(loss)/d(hidden).

    Returns (loss_sum, ce_sum, correct, counted, tau_sum, runs, top_logits, top_ids, position_weights, grad or
    None). With ``settings.fused_kernels`` the logit statistics and the logit gradient run as compiled kernels
    (the same functions, compiled); ``top_k`` > 0: each row's top_k logits (float32) and token ids from the same
    logits, and the objective's weight of each position [N, P] (empty tensors for 0).
    """
    n_blocks, p, h = hidden.shape
    obj, gamma, fused = settings.objective, float(settings.gamma), settings.fused_kernels
    chunk = max(1, int(settings.chunk_tokens) // max(1, p))
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 logits (fp64 when the inputs are)
    dev = hidden.device
    grouped = bool(top_k) and groups_pay(weight.shape[0], top_k)  # the stats also give grouped_topk's maxima
    stats = logit_statistics(grouped, fused)
    logit_grad = _compiled(_logit_grad) if fused else _logit_grad
    grad = torch.empty(hidden.shape, dtype=acc, device=dev) if need_grad else None  # every chunk writes its rows
    decay = position_decay(p + 1, gamma, dev, acc)
    loss_sum, ce_sum, tau_sum = (torch.zeros((), dtype=acc, device=dev) for _ in range(3))
    correct, counted = torch.zeros(p, dtype=acc, device=dev), torch.zeros(p, dtype=acc, device=dev)
    runs = torch.zeros(n_blocks, dtype=acc, device=dev)
    # the candidates are written in place, each chunk's into its rows; the logits in the lm_head's dtype, float32
    # once at the end (an exact upcast, or fp64 rounded as a float32 buffer would)
    top_logits = torch.empty(n_blocks * p, top_k, dtype=weight.dtype, device=dev)
    top_ids = torch.empty(n_blocks * p, top_k, dtype=torch.long, device=dev)
    position_weights = torch.zeros(n_blocks if top_k else 0, p, dtype=acc, device=dev)  # for the selector's term
    for s in range(0, n_blocks, chunk):
        e = min(n_blocks, s + chunk)
        lab, ok = labels[s:e], valid[s:e]
        # the compiled kernels' labels start at offset 0 in every chunk: a slice's offset (0 for the first chunk,
        # s*p after) made them compile twice more, once per side of the framework's 0/1 specialisation
        flat_lab = lab.reshape(-1).clone() if fused else lab.reshape(-1)
        val = ok.to(acc)
        # cast, then flattened: one copy (the cast of the draft positions' strided view is already contiguous)
        raw = F.linear(hidden[s:e].to(weight.dtype).reshape(-1, h), weight, bias)  # [rows, V], lm_head dtype
        if grouped:
            lse, tgt, top, group_max = stats(raw, flat_lab, acc, TOPK_GROUP)
        else:
            (lse, tgt, top), group_max = stats(raw, flat_lab, acc), None
        if top_k:  # the selector's candidates, from these logits (module notes)
            if raw.dtype != top_logits.dtype:  # autocast around the engine: the logits' own dtype
                top_logits = top_logits.to(raw.dtype)
            grouped_topk(raw, top_k, group_max=group_max, out=(top_logits[s * p:e * p], top_ids[s * p:e * p]))
        ce = (lse - tgt).view(e - s, p) * val
        term, teacher_p = ce, None
        if obj.soft:  # the teacher's distribution over the same rows (kl)
            t_logp = torch.log_softmax(F.linear(teacher[s:e].reshape(-1, h).to(weight.dtype), weight, bias).to(acc),
                                       dim=-1)
            teacher_p = t_logp.exp()
            # KL(p_t || q) = sum_v p_t (log p_t - x_v) + lse, as sum_v p_t = 1
            kl = ((teacher_p * (t_logp - raw.to(acc))).sum(-1) + lse).view(e - s, p) * val
            term = (1.0 - obj.soft) * ce + obj.soft * kl
            del t_logp
        w = obj.weights(ce, val, decay)
        if top_k:
            position_weights[s:e] = w
        # -- the one metrics block
        loss_sum += (w * term).sum()
        ce_sum += ce.sum()
        hit = (top.view(e - s, p) == lab) & ok
        correct += hit.sum(0).to(acc)
        counted += val.sum(0)
        runs[s:e] = torch.cumprod(hit.to(acc), dim=-1).sum(-1)
        tau_sum += ((1.0 + runs[s:e]) * ok.any(-1)).sum()
        if need_grad:
            soft_p = None if teacher_p is None else teacher_p.mul_(obj.soft)
            g = logit_grad(raw, lse, flat_lab, w.reshape(-1), 1.0 - obj.soft, soft_p)
            grad[s:e].view(-1, h).copy_(g @ weight)  # upcast as it is written
            del g
        del raw, teacher_p
    top_logits = top_logits.to(torch.float32).view(n_blocks, p, top_k)
    return (loss_sum, ce_sum, correct, counted, tau_sum, runs, top_logits, top_ids.view(n_blocks, p, top_k),
            position_weights, grad)


class _ChunkedBlockLoss(torch.autograd.Function):
    """The engine as an autograd function: the forward computes the gradient with the loss (the lm_head is
    frozen: no weight gradient), the backward scales it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid, teacher, settings, top_k):
        need_grad = ctx.needs_input_grad[0]
        *sums, grad = chunked_logit_statistics(hidden, weight, bias, labels, valid, teacher, settings, need_grad,
                                               top_k)
        ctx.save_for_backward(grad if need_grad else torch.zeros(0))
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(*sums[1:])
        return tuple(sums)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        (grad,) = ctx.saved_tensors
        g = (grad * grad_loss).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        return g, None, None, None, None, None, None, None


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
               settings: LossSettings = LossSettings(), *, teacher_hidden: torch.Tensor | None = None,
               lm_head_bias: torch.Tensor | None = None, top_k: int = 0) -> BlockLossOutput:
    """Chunked block loss.

    hidden: [N, B-1, H] drafter outputs at draft positions 1..B-1; labels (long) / valid (bool): [N, B-1];
    settings: the objective and the engine's chunking and kernels (``LossSettings``);
    teacher_hidden: [N, B-1, H] target final-norm outputs at positions a+k-1 (``kl`` only);
    top_k: also each position's top_k logits and ids (``top_logits``, ``top_ids``; DFlash2's selector candidates)
    and the objective's weight of each position (``position_weights``, detached).
    """
    if settings.variant == "kl" and teacher_hidden is None:
        raise UserError("loss variant 'kl' needs last_hidden in the shards (extract with --store-last-hidden)")
    teacher = teacher_hidden if settings.variant == "kl" else None
    out = _ChunkedBlockLoss.apply(hidden, lm_head_weight.detach(),
                                  None if lm_head_bias is None else lm_head_bias.detach(),
                                  labels, valid.bool(), teacher, settings, int(top_k))
    *sums, top_logits, top_ids, position_weights = out
    return BlockLossOutput(*sums, blocks=valid.any(-1).sum(), top_logits=top_logits if top_k else None,
                           top_ids=top_ids if top_k else None, position_weights=position_weights if top_k else None)
