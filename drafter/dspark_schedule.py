"""How many of a DSpark block's drafts to verify, from its confidence head (arXiv 2607.05147 section 3.2).

The head's c_k = sigmoid(logit_k) estimates that draft k is accepted given that drafts 1..k-1 were, so the
chance that the first j drafts all are is the prefix survival a_j = prod_{i <= j} c_i. Two rules:
- ``confident_prefix_length``: a static threshold, the reference's evaluation rule (deepseek-ai/DeepSpec
  deepspec/eval/dspark/draft_ops.py ``_confident_prefix_length``): verify the drafts before the first whose c_k is
  below the threshold (every draft when the threshold is <= 0).
- ``schedule_verify_lengths``: the paper's load-aware prefix scheduler (Algorithm 1). For R requests it admits
  drafts in the order of their a_{r,j} (highest first; a request's j-th before its (j+1)-th since a_j is
  non-increasing), growing the verified batch B = sum_r (1 + l_r) one token at a time, and keeps the lengths at
  which the expected throughput tau * SPS(B) was best (tau = sum_r (1 + sum_{j <= l_r} a_{r,j})); it stops at the
  first admission that does not raise it, so no decision depends on a draft not yet admitted (the paper's
  losslessness argument). SPS(B) is the target's measured verification steps per second at B tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def prefix_survival(confidence_logits: torch.Tensor) -> torch.Tensor:
    """a_j = prod_{i <= j} sigmoid(logit_i) along the last axis: [..., P] -> [..., P] (float64)."""
    return torch.sigmoid(confidence_logits.double()).cumprod(dim=-1)


def confident_prefix_length(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per block, the number of leading drafts whose c_k >= ``threshold``: [b, P] -> [b] (long)."""
    below = torch.sigmoid(confidence_logits.double()) < threshold
    if threshold <= 0:
        below = torch.zeros_like(below)
    # the first True's index, or P when there is none: count the leading Falses
    return (~below).long().cumprod(dim=-1).sum(dim=-1)


def schedule_verify_lengths(survival: torch.Tensor, steps_per_second: Sequence[float]) -> list[int]:
    """Algorithm 1: each request's number of drafts to verify. survival [R, P] (``prefix_survival``);
    ``steps_per_second[B]`` = the target's steps per second verifying B tokens, for B = R .. R * (1 + P)."""
    num_requests, num_drafts = survival.shape
    if len(steps_per_second) <= num_requests * (1 + num_drafts):
        raise ValueError(f"steps_per_second has {len(steps_per_second)} entries; it needs one per batch size up to "
                         f"{num_requests * (1 + num_drafts)} (index = tokens verified)")
    a = survival.double().cpu()
    candidates = [(float(a[r, j]), r, j + 1) for r in range(num_requests) for j in range(num_drafts) if a[r, j] > 0]
    candidates.sort(key=lambda c: -c[0])  # stable: a request's equal survivals keep their order
    lengths = [0] * num_requests
    tokens, expected = num_requests, float(num_requests)  # every request verifies its bonus token
    best_throughput, best = expected * steps_per_second[tokens], list(lengths)
    for survive, request, length in candidates:
        lengths[request] = length
        tokens += 1
        expected += survive
        throughput = expected * steps_per_second[tokens]
        if throughput <= best_throughput:
            break
        best_throughput, best = throughput, list(lengths)
    return best
