"""Anchors: where the blocks of a training sequence start.

Design choices:
- A position p can anchor a block when ``loss_mask[p]`` and ``loss_mask[p + 1]`` both hold: the anchor token
  belongs to a trained (assistant) span and so does at least the first token the block predicts.
- Training draws ``num_anchors`` of those positions without replacement (all of them when there are fewer;
  or, with ``anchor_density``, a number proportional to the sequence's tokens: ``anchor_count``)
  and returns them sorted, so block n of the packed pass starts at the n-th smallest anchor (this keeps the
  block mask close to causal, which flex_attention exploits).
- Every draw takes an explicit ``torch.Generator`` seeded from (run seed, epoch, sample index): the anchors of
  a sample do not depend on which rank or which step drew them, so a resumed run draws the same anchors.
- Held-out anchors for tau_sim are fixed by (seed, sample index) and prefer positions whose whole block
  (anchor + block_size - 1 labels) lies inside the trained span, so the ceiling of tau_sim is block_size.
"""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p+1] (1-D LongTensor, ascending)."""
    m = loss_mask.bool().reshape(-1)
    if m.numel() < 2:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).reshape(-1)


def sample_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator whose seed mixes the run seed with keys such as (epoch, sample index)."""
    s = int(seed) & 0xFFFFFFFF
    for k in keys:  # a small integer hash (splitmix-style) keeps nearby keys far apart
        s = (s * 0x9E3779B1 + int(k) + 0x7F4A7C15) & 0xFFFFFFFFFFFF
    g = torch.Generator()
    g.manual_seed(s)
    return g


def anchor_count(num_tokens: int, num_anchors: int, anchor_density: float = 0.0) -> int:
    """Blocks to draw for a sequence of ``num_tokens`` tokens: ``num_anchors``, or with ``anchor_density`` > 0
    round(anchor_density * num_tokens) (at least 1). A function of the sequence alone, so a packed micro-batch of
    T tokens holds about anchor_density * T blocks whichever sequences share it, and packing, re-sharding or
    resuming never changes a sample's draw (a budget split over the sequences of each micro-batch would)."""
    if anchor_density <= 0:
        return int(num_anchors)
    return max(1, int(round(float(anchor_density) * int(num_tokens))))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int = 512,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``num_anchors`` distinct anchors drawn uniformly among the candidates, sorted ascending."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    cand = anchor_candidates(loss_mask)
    if cand.numel() <= num_anchors:
        return cand
    pick = torch.randperm(cand.numel(), generator=generator)[:num_anchors]
    return cand[pick].sort().values


def eval_anchors(loss_mask: torch.Tensor, block_size: int, num_anchors: int, seed: int,
                 sample_index: int) -> torch.Tensor:
    """Fixed held-out anchors: the same for every run with the same seed (sorted ascending).

    Positions whose block lies entirely in the trained span are used when the sample has any; otherwise the
    training candidates.
    """
    m = loss_mask.bool().reshape(-1)
    t = m.numel()
    full = torch.zeros(0, dtype=torch.long)
    if t >= block_size:
        windows = m.unfold(0, block_size, 1).all(dim=1)  # windows[p] = all(m[p : p + block_size])
        full = torch.nonzero(windows, as_tuple=False).reshape(-1)
    cand = full if full.numel() else anchor_candidates(m)
    if cand.numel() <= num_anchors:
        return cand
    g = sample_generator(seed, 0x5EED, sample_index)
    return cand[torch.randperm(cand.numel(), generator=g)[:num_anchors]].sort().values
