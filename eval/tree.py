"""Draft trees for one verification round.

Design choices:
- A DFlash drafter scores every block position in one pass, independently of the tokens chosen before it, so the
  candidates at depth d are the top-k tokens of draft position d whatever their parent is. A DSpark drafter adds
  a bias that depends on the token before (its Markov head): a node's children are the top-k of depth d's logits
  plus the bias of the node's own token (``node_bias``), the tree form of its left-to-right walk.
- The tree grows best-first by cumulative draft log-probability until it holds `budget` nodes (root included).
  Scores only fall along a path and across ranks, so a lazy frontier (after taking a node, offer its next-ranked
  sibling and its first child) takes nodes in exactly best-first order, and every parent precedes its children.
- Node 0 is the root, the last accepted token; its depth is 0 and it sits at position `prefix length + depth`.
- A chain of B - 1 drafts is the tree with parents [-1, 0, 1, ...]; top-1 trees are chains.
- The ancestor mask (node i sees node j iff j is i or an ancestor of i) is built by pointer doubling on the
  device, a fixed log2(depth) steps, so it needs no host round trip and can live inside a CUDA graph.
- The drafter's top-k scores and tokens come to the host in one read (the tree is grown there).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # token of each node; node 0 is the root (last accepted token)
    parents: list[int]  # parent node index; parents[0] == -1 and parents[i] < i
    depths: list[int]  # distance from the root; the node's position is prefix length + depth
    scores: list[float]  # cumulative draft log-probability of the path to the node (root: 0)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, root_token: int, draft_tokens: list[int], scores: list[float] | None = None) -> "DraftTree":
        n = len(draft_tokens)
        return cls(tokens=[root_token, *draft_tokens], parents=list(range(-1, n)), depths=list(range(n + 1)),
                   scores=[0.0, *(scores or [0.0] * n)])

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, self.num_nodes - 1))

    def tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parents, depths) as LongTensors on `device`."""
        return (torch.tensor(self.tokens, dtype=torch.long, device=device),
                torch.tensor(self.parents, dtype=torch.long, device=device),
                torch.tensor(self.depths, dtype=torch.long, device=device))


def _top_k_rows(logits: torch.Tensor, k: int) -> tuple[list, list]:
    """(log-probabilities, token ids) of the k most likely tokens of each row of logits [..., V], on the host in
    one read (ids are exact in float64)."""
    scores, tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    both = torch.stack([scores.double(), tokens.double()]).tolist()
    return both[0], [[int(t) for t in row] for row in both[1]] if logits.dim() > 1 else [int(t) for t in both[1]]


def build_tree(root_token: int, draft_logits: torch.Tensor, budget: int, top_k: int,
               node_bias: Callable[[int], torch.Tensor] | None = None) -> DraftTree:
    """Best-first tree over draft positions 1..D.

    draft_logits [D, V]: the drafter's logits for depths 1..D. budget: total nodes including the root (>= 1).
    top_k: children considered per node (the top-k tokens of that depth's position). ``node_bias`` (a DSpark
    drafter's Markov head): token -> [V], added to the logits of the children of a node holding that token, so
    each node's children are the top-k of its own distribution (one host read per node that gets children).
    """
    if budget < 1 or top_k < 1:
        raise ValueError(f"tree budget and top_k must be >= 1, got budget={budget}, top_k={top_k}")
    max_depth = draft_logits.shape[0]
    k = min(top_k, draft_logits.shape[-1])
    by_depth = _top_k_rows(draft_logits, k) if node_bias is None else None
    by_node: dict[int, tuple[list, list]] = {}

    tree = DraftTree(tokens=[root_token], parents=[-1], depths=[0], scores=[0.0])
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, tiebreak, parent, depth, rank)
    counter = 0

    def children(parent: int, depth: int) -> tuple[list, list]:
        if by_depth is not None:
            return by_depth[0][depth - 1], by_depth[1][depth - 1]
        if parent not in by_node:
            by_node[parent] = _top_k_rows(draft_logits[depth - 1] + node_bias(tree.tokens[parent]), k)
        return by_node[parent]

    def offer(parent: int, depth: int, rank: int) -> None:
        nonlocal counter
        if depth <= max_depth and rank < k:
            score = tree.scores[parent] + children(parent, depth)[0][rank]
            heapq.heappush(frontier, (-score, counter, parent, depth, rank))
            counter += 1

    offer(0, 1, 0)
    while frontier and tree.num_nodes < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(frontier)
        node = tree.num_nodes
        tree.tokens.append(children(parent, depth)[1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg_score)
        offer(parent, depth, rank + 1)
        offer(node, depth + 1, 0)
    return tree


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Bool [..., N, N]: mask[i, j] is True iff node j is node i or one of its ancestors.

    parents: LongTensor [..., N] with -1 at roots. max_depth: a bound on the depth of any node (default N - 1).
    Pointer doubling: with seen[i] = the ancestors of i within distance r and jump[i] = its ancestor at distance r,
    seen[i] | seen[jump[i]] is those within 2r and jump[jump[i]] the one at 2r; ceil(log2(max_depth)) steps of
    three kernels each. An extra null node N (the parent of every root and of itself, seeing nothing) stands for
    "no ancestor", so the steps need no masking.
    """
    n = parents.shape[-1]
    max_depth = n - 1 if max_depth is None else max_depth
    batch = parents.shape[:-1]
    jump = torch.cat([parents.masked_fill(parents < 0, n), parents.new_full((*batch, 1), n)], dim=-1)  # [..., N+1]
    nodes = torch.arange(n, device=parents.device)
    eye = torch.eye(n + 1, n, dtype=torch.bool, device=parents.device)  # the null node's row sees nothing
    mask = eye | (jump.unsqueeze(-1) == nodes)  # [..., N+1, N]: itself and its parent
    reach = 1
    while reach < max_depth:
        mask = mask | torch.gather(mask, -2, jump.unsqueeze(-1).expand(*jump.shape, n))
        jump = torch.gather(jump, -1, jump)
        reach *= 2
    return mask[..., :n, :]
