"""Block-prediction losses, computed in chunks through the target's lm_head.

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

Design choices:
- Never materialise [blocks*(B-1), vocab] fp32 logits: a custom autograd function walks the blocks in chunks,
  computes the logits, the loss and d(loss)/d(hidden) of each chunk at once (the lm_head is frozen, so no
  weight gradient), keeps only the [*, H] gradient and returns it in backward. Cost: one lm_head forward and
  one input-gradient matmul per token, no recomputation. Chunks hold whole blocks (D-PACE needs the block).
- The function returns the *un-normalised* weighted sum. The trainer divides by the global denominator
  (``loss_denominator`` summed over all micro-batches of the step and over all ranks), so gradient
  accumulation and data parallelism give exactly the single-process gradient.
- ``fused=True`` (CUDA training with ``compile``) runs the ce and dpace chunks through two small compiled
  kernels: one reads the lm_head's logits for logsumexp, label logit and argmax, one writes the logit gradient
  in the lm_head's dtype. The eager path keeps fp32 logits and several full passes over them (~44 bytes per
  logit against ~10 fused), which makes the loss memory-bound on the vocabulary; it stays the reference and the
  CPU path, and tests hold the fused one to it.
- Metrics come out of the same pass: per-position correct/valid counts and the tau_sim sum (1 + leading run of
  positions whose argmax equals the label; an invalid label ends the run) over the blocks that have at least
  one valid label (padding blocks of a packed micro-batch have none and count nowhere), and each block's run
  (held-out evaluation replays live decoding from them: train/step.py). All of them stay on the device:
  nothing here waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


@dataclass
class BlockLossOutput:
    loss_sum: torch.Tensor  # weighted loss summed over blocks (differentiable w.r.t. hidden); divide by the denominator
    ce_sum: torch.Tensor  # plain CE summed over valid labels (for logging)
    correct: torch.Tensor  # [B-1] valid labels whose argmax matched, per draft position
    counted: torch.Tensor  # [B-1] valid labels per draft position
    tau_sum: torch.Tensor  # sum over counted blocks of 1 + leading run of correct positions
    runs: torch.Tensor  # [N] per block, its leading run of correct positions (0 for blocks with no valid label)
    blocks: torch.Tensor  # counted blocks: those with at least one valid label
    selector: object = None  # DFlash2: the selector term of the same pass (train/selector_loss.py), else None


def _logit_stats(logits: torch.Tensor, labels: torch.Tensor, acc: torch.dtype):
    """Per row: logsumexp, the label's logit and the argmax, reading the logits once (upcast in registers)."""
    x = logits.to(acc)
    return torch.logsumexp(x, dim=-1), x.gather(-1, labels.unsqueeze(-1)).squeeze(-1), x.argmax(-1)


def _logit_grad(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w * (softmax - onehot(label)) in the logits' dtype."""
    x = logits.to(lse.dtype)
    onehot = torch.arange(x.shape[-1], device=x.device) == labels.unsqueeze(-1)
    return ((torch.exp(x - lse.unsqueeze(-1)) - onehot.to(x.dtype)) * w.unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict = {}


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


class _ChunkedBlockLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid, teacher, variant, gamma, alpha, kl_weight, chunk, fused):
        n_blocks, p, h = hidden.shape
        need_grad = ctx.needs_input_grad[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 logits (fp64 when the inputs are)
        grad = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_grad else None
        decay = position_decay(p + 1, gamma, hidden.device, acc)
        loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
        ce_sum = torch.zeros_like(loss_sum)
        correct = torch.zeros(p, dtype=acc, device=hidden.device)
        counted = torch.zeros_like(correct)
        tau_sum = torch.zeros_like(loss_sum)
        runs = torch.zeros(n_blocks, dtype=acc, device=hidden.device)
        w_mat = weight
        for s in range(0, n_blocks, chunk):
            e = min(n_blocks, s + chunk)
            hs = hidden[s:e].reshape(-1, h).to(w_mat.dtype)
            if fused and variant != "kl":
                lab, val = labels[s:e], valid[s:e].to(acc)
                raw = F.linear(hs, w_mat, bias)
                lse, tgt, top = _compiled(_logit_stats)(raw, lab.reshape(-1), acc)
                ce = (lse - tgt).view(e - s, p) * val
                w = dpace_weights(ce, val, alpha) if variant == "dpace" else decay * val
                loss_sum += (w * ce).sum()
                ce_sum += ce.sum()
                hit = (top.view(e - s, p) == lab) & valid[s:e]
                correct += hit.sum(0).to(acc)
                counted += val.sum(0)
                runs[s:e] = torch.cumprod(hit.to(acc), dim=-1).sum(-1)
                tau_sum += ((1.0 + runs[s:e]) * valid[s:e].any(-1)).sum()
                if need_grad:
                    g = _compiled(_logit_grad)(raw, lse, lab.reshape(-1), w.reshape(-1))
                    grad[s:e] = (g @ w_mat).to(acc).view(e - s, p, h)
                del raw
                continue
            logits = F.linear(hs, w_mat, bias).to(acc).view(e - s, p, -1)
            logp = torch.log_softmax(logits, dim=-1)
            lab = labels[s:e]
            val = valid[s:e].to(acc)
            ce = -logp.gather(-1, lab.unsqueeze(-1)).squeeze(-1) * val
            if variant == "dpace":
                w = dpace_weights(ce, val, alpha)
            else:
                w = decay * val
            per_pos = ce
            teacher_p = None
            if variant == "kl":
                t_logits = F.linear(teacher[s:e].reshape(-1, h).to(w_mat.dtype), w_mat, bias).to(acc)
                t_logp = torch.log_softmax(t_logits, dim=-1).view(e - s, p, -1)
                teacher_p = t_logp.exp()
                kl = (teacher_p * (t_logp - logp)).sum(-1) * val
                per_pos = (1.0 - kl_weight) * ce + kl_weight * kl
                del t_logits, t_logp
            loss_sum += (w * per_pos).sum()
            ce_sum += ce.sum()
            hit = (logits.argmax(-1) == lab) & valid[s:e]
            correct += hit.sum(0).float()
            counted += val.sum(0)
            runs[s:e] = torch.cumprod(hit.to(acc), dim=-1).sum(-1)
            tau_sum += ((1.0 + runs[s:e]) * valid[s:e].any(-1)).sum()
            if need_grad:
                # d/dlogits of w*((1-b)CE + b*KL) = w * (softmax - (1-b)*onehot - b*p_target)
                g = logp.exp_()
                del logits
                if teacher_p is not None:
                    g.sub_(teacher_p, alpha=kl_weight)
                    hard = 1.0 - kl_weight
                else:
                    hard = 1.0
                g.scatter_add_(-1, lab.unsqueeze(-1), torch.full_like(w.unsqueeze(-1), -hard))
                g.mul_(w.unsqueeze(-1))
                grad[s:e] = (g.view(-1, g.shape[-1]).to(w_mat.dtype) @ w_mat).to(acc).view(e - s, p, h)
                del g
        ctx.save_for_backward(grad if need_grad else torch.zeros(0))
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(ce_sum, correct, counted, tau_sum, runs)
        return loss_sum, ce_sum, correct, counted, tau_sum, runs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        (grad,) = ctx.saved_tensors
        g = None
        if ctx.needs_input_grad[0]:
            g = (grad * grad_loss).to(ctx.hidden_dtype)
        return g, None, None, None, None, None, None, None, None, None, None, None


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *,
               variant: str = "ce", gamma: float = 7.0, dpace_alpha: float = 0.5, kl_weight: float = 0.5,
               teacher_hidden: torch.Tensor | None = None, lm_head_bias: torch.Tensor | None = None,
               chunk_tokens: int = 2048, fused: bool = False) -> BlockLossOutput:
    """Chunked block loss.

    hidden: [N, B-1, H] drafter outputs at draft positions 1..B-1; labels (long) / valid (bool): [N, B-1];
    teacher_hidden: [N, B-1, H] target final-norm outputs at positions a+k-1 (``kl`` only);
    chunk_tokens: rows of logits alive at once (rounded to whole blocks);
    fused: compiled logit kernels for ce and dpace (see the module notes; kl always runs eager).
    """
    if variant not in VARIANTS:
        raise ValueError(f"loss variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "kl" and teacher_hidden is None:
        raise ValueError("loss variant 'kl' needs last_hidden in the shards (extract with --store-last-hidden)")
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must be in [0, 1], got {kl_weight}")
    p = hidden.shape[1]
    chunk = max(1, int(chunk_tokens) // max(1, p))
    teacher = teacher_hidden if variant == "kl" else None
    out = _ChunkedBlockLoss.apply(hidden, lm_head_weight.detach(),
                                  None if lm_head_bias is None else lm_head_bias.detach(),
                                  labels, valid.bool(), teacher, variant, float(gamma), float(dpace_alpha),
                                  float(kl_weight), chunk, bool(fused))
    return BlockLossOutput(*out, blocks=valid.any(-1).sum())

