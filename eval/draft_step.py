"""The drafter's pass of a round on static buffers, replayed as a CUDA graph on CUDA (eager on the CPU).

Design choices:
- The drafter is called through its public forward with our own `past_key_values` (`StaticDraftCache`: any
  object with `update(k, v, layer_idx)`) and an attention mask, so the same forward serves training, export and
  this fast path.
- A pass sees C new context rows (the features of the tokens accepted last round) and the block [anchor,
  MASK x (Q - 1)]. The cache holds the context of earlier rounds in slots [0, L); this pass writes its context at
  [L, L + C) and the block after it, and the mask lets every query see slots [0, L + C + Q): exactly the keys a
  growing cache cropped back to the anchor would hold (full-attention drafter layers are non-causal). The block's
  slots are overwritten next round, which replaces the crop.
- After the first round C <= block size, so a step pads its context to the block size; padded rows are written
  to a scratch area at the end of the buffers and never seen. One step per block length Q (Q is the block size
  except at the end of a sequence); the first round (C = prompt length) runs eagerly.
- Drafters with sliding-window layers (a causal mask over the key index) keep the eager DynamicCache path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .graphs import capture_graph


def supports_static_steps(drafter: nn.Module) -> bool:
    return all(t == "full_attention" for t in (getattr(drafter.config, "layer_types", None) or []))


class StaticDraftCache:
    """Per-layer K/V buffers [1, Hkv, max_len, d]; update() writes at `slots` and returns the whole buffers."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots: torch.Tensor | None = None  # set by the step before each forward

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            self.keys[layer_idx] = key.new_zeros(*key.shape[:2], self.max_len, key.shape[-1])
            self.values[layer_idx] = value.new_zeros(*value.shape[:2], self.max_len, value.shape[-1])
        self.keys[layer_idx].index_copy_(2, self.slots, key)
        self.values[layer_idx].index_copy_(2, self.slots, value)
        return self.keys[layer_idx], self.values[layer_idx]


class DraftStep:
    """One shape: `context_rows` context rows (padded), a block of `size` tokens."""

    def __init__(self, owner: "StaticDrafter", context_rows: int, size: int, use_graph: bool):
        device, self.owner = owner.device, owner
        self.context_rows, self.size, self.use_graph = context_rows, size, use_graph
        self.context = torch.zeros(1, context_rows, owner.feature_size, dtype=owner.drafter.dtype, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # real context rows C
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the anchor's position
        self.block = torch.full((1, size), owner.mask_token_id, dtype=torch.long, device=device)
        self.rows = torch.arange(context_rows, device=device)
        self.block_index = torch.arange(size, device=device)
        self.key_index = torch.arange(owner.cache.max_len, device=device)
        self.graph = None
        self.logits = None

    def load(self, anchor: int, context: torch.Tensor, start: int) -> None:
        count = context.shape[0]
        self.context[0, :count].copy_(context, non_blocking=True)
        self.count.fill_(count)
        self.start.fill_(start)
        self.block[0, 0].fill_(anchor)

    def _compute(self) -> torch.Tensor:
        o, cache = self.owner, self.owner.cache
        cached = self.start - self.count  # L: context rows of earlier rounds
        real = self.rows < self.count
        context_positions = torch.where(real, cached + self.rows, self.start)
        positions = torch.cat([context_positions, self.start + self.block_index]).view(1, -1)
        scratch = cache.max_len - self.context_rows + self.rows
        cache.slots = torch.cat([torch.where(real, cached + self.rows, scratch), self.start + self.block_index])
        mask = (self.key_index < self.start + self.size).view(1, 1, 1, -1)
        noise = F.embedding(self.block, o.embed_weight) * o.embed_scale
        hidden = o.drafter(position_ids=positions, attention_mask=mask, noise_embedding=noise.to(o.drafter.dtype),
                           target_hidden=self.context, past_key_values=cache, use_cache=True)
        return o.drafter.compute_logits(hidden[:, 1 - self.size:, :].to(o.lm_head.weight.dtype), o.lm_head)[0]

    def run(self) -> torch.Tensor:
        if not self.use_graph:
            return self._compute()
        if self.graph is None:
            self.graph, self.logits = capture_graph(self._compute, self.owner.device, self.owner.graph_pool)
        self.graph.replay()
        return self.logits


class StaticDrafter:
    """The drafter with a static context cache; `logits(anchor, context, start, size)` as the eager pass."""

    def __init__(self, drafter: nn.Module, embed_weight: torch.Tensor, embed_scale: float, lm_head: nn.Module,
                 mask_token_id: int, block_size: int, cuda_graphs: bool):
        self.drafter, self.embed_weight, self.embed_scale, self.lm_head = drafter, embed_weight, embed_scale, lm_head
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.device = embed_weight.device
        self.feature_size = drafter.fc.in_features
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.cache = StaticDraftCache(0)
        self.steps: dict[int, DraftStep] = {}

    def reserve(self, max_len: int) -> None:
        """Room for a sequence of max_len tokens (plus the scratch rows); growing drops the captured steps."""
        needed = -(-max_len // 1024) * 1024 + self.block_size
        if needed > self.cache.max_len:
            self.cache = StaticDraftCache(needed)
            self.steps.clear()

    def _step(self, size: int) -> DraftStep:
        if size not in self.steps:
            self.steps[size] = DraftStep(self, self.block_size, size, self.use_graphs)
        return self.steps[size]

    @torch.inference_mode()
    def prepare(self, sizes: list[int]) -> None:
        """Build (on CUDA: capture) the steps of these block lengths before a run, on dummy inputs; call it
        between sequences (after reserve)."""
        context = torch.zeros(self.block_size, self.feature_size, dtype=self.drafter.dtype, device=self.device)
        for size in sizes:
            step = self._step(size)
            step.load(self.mask_token_id, context, self.block_size)
            step.run()

    @torch.inference_mode()
    def logits(self, anchor: int, context: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """Drafter logits [size - 1, V] for positions start+1 .. start+size-1; context: [C, K*H] new rows."""
        if context.shape[0] > self.block_size:  # the first round: the prompt's features, once per sequence
            step = DraftStep(self, context.shape[0], size, use_graph=False)
        else:
            step = self._step(size)
        step.load(anchor, context, start)
        return step.run()
