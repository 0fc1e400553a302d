"""The acceptance rule of speculative decoding, written once; every fast path is tested against it.

Design choices:
- A verification round checks candidate tokens laid out as a tree. Node 0 is the root: the last accepted token,
  which the target has not consumed yet. A chain is the tree whose node i has parent i - 1.
- Greedy: walk from the root; at each node the target's argmax is the token it wants next; step into the child
  carrying that token, else stop. The target's argmax at the last node reached is the bonus token. The accepted
  path is therefore exactly the prefix of what greedy autoregressive decoding of the target would have written.
- Sampled (temperature > 0, chain only): speculative sampling. Draft token x at depth k is kept with probability
  min(1, p(x) / q(x)) (p = target, q = drafter, both softmax(logits / T)); at the first rejection the replacement
  is drawn from max(p - q, 0) renormalised; if every draft is kept the bonus is drawn from p at the last node.
  The emitted tokens are distributed exactly as the target's own samples (lossless). With top-k / top-p both p
  and q are the filtered distributions (`sampling_probs`), as in the reference implementation.
- The walk runs on the host over a few hundred integers; logits and probabilities may live on any device.
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution a token is sampled from, in fp32, as the reference implementation builds it:
    softmax(logits / temperature) over the top_k most likely tokens (0 = all), then only the smallest set of
    most likely tokens whose mass reaches top_p (the token that crosses top_p is kept), renormalised."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # mass strictly before the token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy_accept(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Longest root path the target agrees with, under greedy decoding.

    tokens[i]: token of node i (node 0 = root); parents[i]: parent node (parents[0] = -1, parents[i] < i);
    target_argmax[i]: the target's greedy next token after the path ending at node i.
    Returns (path, bonus): node indices from the root (path[0] == 0) and the target's token after the path.
    """
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], {}).setdefault(tokens[node], node)
    path = [0]
    while True:
        wanted = target_argmax[path[-1]]
        child = children.get(path[-1], {}).get(wanted)
        if child is None:
            return path, wanted
        path.append(child)


def sampled_accept_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling on a chain.

    draft_tokens [D]: the drafted tokens (depths 1..D); draft_probs [D, V]: the drafter's distribution each was
    drawn from; target_probs [D + 1, V]: the target's distribution after the root and after each draft.
    Returns (number of drafts accepted, the next token: replacement at the first rejection or the bonus).
    """
    num_drafts = draft_tokens.shape[0]
    device = target_probs.device
    uniform = torch.rand(num_drafts, generator=generator, device=device)
    rows = torch.arange(num_drafts, device=device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    keep = (uniform * q < p).tolist()  # u < p/q without dividing by q
    accepted = 0
    while accepted < num_drafts and keep[accepted]:
        accepted += 1
    if accepted == num_drafts:
        final = target_probs[num_drafts]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        # p == q leaves nothing to correct; then p itself is the right distribution.
        final = residual / total if total.item() > 0 else target_probs[accepted]
    next_token = torch.multinomial(final, 1, generator=generator).item()
    return accepted, next_token
