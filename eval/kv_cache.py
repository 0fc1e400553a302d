"""The target's KV cache during verification: preallocated per-layer buffers, and the compaction of kept nodes.

Design choices:
- The runtime's static cache (targets/runtime/static_cache.py: one [b, Hkv, max_len, d] buffer per layer,
  allocated on the first write, shaped after the layer); slots [0, length) are committed, the rest is free.
- A forward writes its nodes at slots [P, P + N) and commits nothing. Keeping a path of nodes that are not the
  leading ones (a tree round) moves their K/V to slots P, P + 1, ... (`Compaction`): one gather and one scatter
  per layer and buffer, captured as one CUDA graph per node count on CUDA, run eagerly on the CPU.
"""

from __future__ import annotations

import torch

from dflashkit.targets.runtime.graphs import Staging, capture_graph
from dflashkit.targets.runtime.static_cache import StaticKV


class KVCache(StaticKV):
    """The runtime's static K/V for one batch of sequences; slots [0, length) are committed."""

    def __init__(self, max_len: int = 0):
        super().__init__(max_len, fix="evaluate shorter prompts or fewer --max-new-tokens")
        self.length = 0  # committed tokens

    def reserve(self, max_len: int) -> None:
        """Make room for max_len slots (buffers are reallocated on the next write when they grow; reset first)."""
        if max_len > self.max_len:
            self.max_len = max_len
            self.clear()
            self.length = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots is full ({self.length} kept + {n} new); "
                               "reserve() prompt length + max_new_tokens + one round of nodes")

    def reset(self) -> None:
        self.length = 0



class Compaction:
    """Keep the accepted nodes of a `size`-node forward when they are not its leading nodes: in every layer the
    K/V at slots P + keep[j] move to P + j. keep is padded to `size` with j itself (those moves change nothing;
    the slots past the kept nodes are free anyway), so one static step (one CUDA graph) serves every path. Its
    graph has a memory pool of its own: it runs between the verify step and the reading of that step's features,
    so its temporaries must never share memory with a verify step's outputs."""

    def __init__(self, cache: KVCache, size: int, device: torch.device, use_graph: bool):
        self.cache, self.size, self.device, self.use_graph = cache, size, device, use_graph
        self.inputs = Staging(size + 1, torch.long, device)  # keep [size], then P
        self.index = torch.arange(size, device=device)
        self.graph = None

    def _compute(self) -> None:
        keep, base = self.inputs.buffer[:self.size], self.inputs.buffer[self.size:]
        source, destination = base + keep, base + self.index
        for buffer in (*self.cache.keys.values(), *self.cache.values.values()):
            buffer.index_copy_(2, destination, buffer.index_select(2, source))

    def _load(self, path: list[int], length: int) -> None:
        host = self.inputs.write()
        host[:] = torch.tensor([*path, *range(len(path), self.size), length])
        self.inputs.send()

    def run(self, path: list[int], length: int) -> torch.Tensor:
        """Move the K/V of `path` (node indices) to the slots after the `length` committed ones; returns keep
        [len(path)] on the device (valid until the next run)."""
        if self.use_graph and self.graph is None:  # captured on the identity, so that its warm-up moves nothing
            self._load([], length)
            self.graph, _ = capture_graph(self._compute, self.device, pool=None)
        self._load(path, length)
        if self.use_graph:
            self.graph.replay()
        else:
            self._compute()
        return self.inputs.buffer[:len(path)]
