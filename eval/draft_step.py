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
- Every layer layout the drafter implements takes this path: the cache slot of a key is its position, so each
  layer's rule is a mask over (query position, key slot) built on the device from the anchor's position alone
  (static shapes): full-attention layers see every written slot; sliding-attention layers (window W) see key j
  from query p iff j <= p and p - j < W, i.e. a window of context and causal inside the block, the rule of
  train/block_mask.py (the drafter's `is_causal` override is honoured, as its eager default mask reads it).
  A drafter with both kinds gets the mask dict keyed by layer type that its forward reads.
- A pass returns a `Draft`: the logits (tree, sampling) and the greedy proposal. For a DFlash2 drafter that is
  the candidate selector's path (`CandidateSelector.select`: its fixed loop over the block's positions, each
  conditioned on the token chosen before it, runs inside the step, so on CUDA it is part of the captured graph);
  for DFlash the argmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.drafter.kinds import drafter_kind
from dflashkit.targets.runtime.graphs import capture_graph
from dflashkit.targets.runtime.static_cache import StaticKV


def layer_rules(drafter: nn.Module) -> dict[str, tuple[bool, int | None]] | None:
    """{layer type: (causal, sliding window)} read from the drafter's attention layers, or None when a layer has
    an attention this step does not know (it would then run eagerly)."""
    rules: dict[str, tuple[bool, int | None]] = {}
    for layer in getattr(drafter, "layers", []):
        attn = getattr(layer, "self_attn", None)
        kind = getattr(attn, "layer_type", None)
        if kind not in ("full_attention", "sliding_attention"):
            return None
        window = attn.sliding_window
        rule = (bool(attn.is_causal), None if window is None else int(window))
        if rules.setdefault(kind, rule) != rule:
            return None
    return rules or None


class Draft(NamedTuple):
    """One drafter pass over a block of Q tokens."""

    logits: torch.Tensor  # [Q - 1, V] draft logits of positions 1 .. Q-1 (the lm_head's dtype)
    tokens: torch.Tensor  # [Q - 1] the greedy proposal: argmax (DFlash) or the candidate selector's path (DFlash2)
    hidden: torch.Tensor  # [1, Q - 1, H] final states of positions 1 .. Q-1 (a sampled DFlash2 path walks them)


def draft_from_hidden(drafter: nn.Module, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor) -> Draft:
    """Logits and greedy proposal from the final states hidden [1, Q - 1, H] of positions 1 .. Q-1; anchor [1] is
    the block's first token (the selector's first predecessor). The proposal is the drafter kind's
    (drafter/kinds/): the argmax for DFlash, the candidate selector's path for DFlash2 (the reference's rule)."""
    logits = drafter.compute_logits(hidden.to(lm_head.weight.dtype), lm_head)
    tokens = drafter_kind(drafter).propose(drafter, hidden, logits, anchor)
    return Draft(logits[0], tokens[0], hidden)


def sample_selector_path(selector: nn.Module, draft: Draft, anchor: int, temperature: float,
                         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash2 block sampled as the reference samples it (CandidateSelector.select with temperature > 0),
    drawn from `generator`: position by position, softmax(scores / temperature) over the position's top-k
    candidates given the token just drawn. Returns (tokens [Q - 1], their distributions [Q - 1, V]: each row the
    candidates' probabilities scattered into the vocabulary, the q of speculative sampling)."""
    unary, candidates = torch.topk(draft.logits, selector.top_k, dim=-1, sorted=False)
    predecessor = torch.full((1,), anchor, dtype=torch.long, device=candidates.device)
    tokens, rows = [], []
    for position in range(candidates.shape[0]):
        at = slice(position, position + 1)
        scores = selector.pair_scores(draft.hidden[0, at], unary[at], candidates[at], predecessor)
        probs = torch.softmax(scores.float() / temperature, dim=-1)
        index = torch.multinomial(probs, 1, generator=generator)
        predecessor = candidates[at].gather(-1, index)[:, 0]
        tokens.append(predecessor)
        rows.append(probs)
    q = torch.zeros(draft.logits.shape, dtype=torch.float32, device=candidates.device)
    return torch.cat(tokens), q.scatter(-1, candidates, torch.cat(rows))


def supports_static_steps(drafter: nn.Module) -> bool:
    return layer_rules(drafter) is not None


def visible_slots(query: torch.Tensor, key: torch.Tensor, written: torch.Tensor, causal: bool,
                  window: int | None) -> torch.Tensor:
    """Bool [1, 1, Q, S]: query position `query` [Q] may attend the key in slot (= position) `key` [S]; `written`
    [S] marks the slots that hold this pass's keys. The drafter's eager default mask, in positions."""
    q, k = query[:, None], key[None, :]
    visible = written[None, :].expand(q.shape[0], -1)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible[None, None]


class StaticDraftCache(StaticKV):
    """The runtime's static K/V [1, Hkv, max_len, d] as the drafter's `past_key_values`: update() writes at
    `slots` and returns the whole buffers."""

    def __init__(self, max_len: int):
        super().__init__(max_len, fix="evaluate shorter prompts or fewer --max-new-tokens")
        self.slots: torch.Tensor | None = None  # set by the step before each forward

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.write(layer_idx, key, value, self.slots)


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
        self.draft: Draft | None = None  # the captured step's outputs (CUDA graphs)

    def load(self, anchor: int, context: torch.Tensor, start: int) -> None:
        count = context.shape[0]
        self.context[0, :count].copy_(context, non_blocking=True)
        self.count.fill_(count)
        self.start.fill_(start)
        self.block[0, 0].fill_(anchor)

    def _compute(self) -> Draft:
        o, cache = self.owner, self.owner.cache
        cached = self.start - self.count  # L: context rows of earlier rounds
        real = self.rows < self.count
        context_positions = torch.where(real, cached + self.rows, self.start)
        positions = torch.cat([context_positions, self.start + self.block_index]).view(1, -1)
        scratch = cache.max_len - self.context_rows + self.rows
        cache.slots = torch.cat([torch.where(real, cached + self.rows, scratch), self.start + self.block_index])
        written, query = self.key_index < self.start + self.size, self.start + self.block_index
        masks = {kind: visible_slots(query, self.key_index, written, causal, window)
                 for kind, (causal, window) in o.rules.items()}
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        noise = F.embedding(self.block, o.embed_weight) * o.embed_scale
        hidden = o.drafter(position_ids=positions, attention_mask=mask, noise_embedding=noise.to(o.drafter.dtype),
                           target_hidden=self.context, past_key_values=cache, use_cache=True)
        return draft_from_hidden(o.drafter, hidden[:, 1 - self.size:, :], o.lm_head, self.block[:, 0])

    def run(self) -> Draft:
        if not self.use_graph:
            return self._compute()
        if self.graph is None:
            self.graph, self.draft = capture_graph(self._compute, self.owner.device, self.owner.graph_pool)
        self.graph.replay()
        return self.draft


class StaticDrafter:
    """The drafter with a static context cache; `draft(anchor, context, start, size)` as the eager pass."""

    def __init__(self, drafter: nn.Module, embed_weight: torch.Tensor, embed_scale: float, lm_head: nn.Module,
                 mask_token_id: int, block_size: int, cuda_graphs: bool):
        self.drafter, self.embed_weight, self.embed_scale, self.lm_head = drafter, embed_weight, embed_scale, lm_head
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.device = embed_weight.device
        self.feature_size = drafter.fc.in_features
        self.rules = layer_rules(drafter)  # {layer type: (causal, window)}: the masks a pass builds
        if self.rules is None:
            raise ValueError("this drafter has an attention layout the static draft step does not know; "
                             "decode it with static_draft=False")
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
    def draft(self, anchor: int, context: torch.Tensor, start: int, size: int) -> Draft:
        """The pass for positions start+1 .. start+size-1 (logits [size - 1, V], greedy proposal [size - 1]);
        context: [C, K*H] new rows."""
        if context.shape[0] > self.block_size:  # the first round: the prompt's features, once per sequence
            step = DraftStep(self, context.shape[0], size, use_graph=False)
        else:
            step = self._step(size)
        step.load(anchor, context, start)
        return step.run()
