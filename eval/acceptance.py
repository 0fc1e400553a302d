"""The acceptance rule of speculative decoding, written once; every fast path is tested against it.

Design choices:
- A verification round checks candidate tokens laid out as a tree. Node 0 is the root: the last accepted token,
  which the target has not consumed yet. A chain is the tree whose node i has parent i - 1.
- Greedy: walk from the root; at each node the target's argmax is the token it wants next; step into the child
  carrying that token, else stop. The target's argmax at the last node reached is the bonus token. The accepted
  path is therefore exactly the prefix of what greedy autoregressive decoding of the target would have written.
- Sampled (temperature > 0, chain only): speculative sampling, `sampled_accept_chain` of the target runtime's
  sampling module (dflashkit/targets/runtime/sampling.py, beside the filtered distribution `sampling_probs` that
  p and q both are); the emitted tokens are distributed exactly as the target's own samples (lossless).
- The walk runs on the host over a few hundred integers; logits and probabilities may live on any device.
"""

from __future__ import annotations


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
