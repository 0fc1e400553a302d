"""The target side of speculative decoding: one forward over candidate nodes, then keep the accepted ones.

Design choices:
- The target keeps its own preallocated KV cache (`KVCache`, one [b, Hkv, max_len, d] buffer per layer), plugged
  in through the attention function: the target runs with `use_cache=False` and attention implementation
  "tree_attention" (registered in transformers' AttentionInterface, so every decoder that dispatches through it
  works unchanged). The function writes the layer's new K/V into slots [P, P + N) of our cache and attends with
  the tree kernel. transformers' own Cache classes are never touched, which keeps 5.17 and 5.24 alike.
  (The name has no "flash" in it: transformers treats such names as flash-attention kernels.)
- A forward does not commit: `commit(path)` keeps the listed nodes, copying their K/V to slots P, P+1, ...
  (compaction, one static step per node count, so one CUDA graph instead of two kernels per layer) and
  advancing P. Node positions are P + depth, so the kept entries are exactly what an autoregressive run over the
  same tokens would have cached. A path of leading nodes (every chain round) is already in place: no copy.
- Prefill, autoregressive steps and chain verification are trees too (parents i - 1); a prefill without prefix
  uses SDPA's causal path instead of a dense mask, eagerly.
- Every step after the prefill (AR step, chain block, tree) runs on static buffers (`StaticStep`, one per shape:
  a chain of N nodes, or a tree padded to the budget) whose inputs are filled in place; the prefix length is a
  device tensor, positions and cache slots are derived from it inside the step, and the kernel's key range is
  bounded by the cache size, not the prefix. On CUDA the step is captured once as a CUDA graph (runtime/graphs.py)
  and replayed; on the CPU, or with cuda_graphs=False, the same code runs eagerly. A chain step takes its tokens
  from a device tensor (the drafts never visit the host); a tree step gets tokens, parents and depths in one
  staged copy and builds the ancestor mask inside the step. Padded tree nodes are roots of their own (parent
  -1): real nodes never see them, and they are never committed. `prepare(shapes)` captures steps before a run.
- Layer features come from dflashkit.targets.capture.LayerCapture in its hooks-only mode (early_exit=False): the
  one capture implementation, so eval reads exactly what extraction and training read (layer i's output is
  Hugging Face hidden_states[i + 1]; layer L - 1 is the final-norm output).
- Logits are computed here, not by the model: the decoder's final hidden state (after the final norm) times an
  fp32 copy of the lm_head weight, in fp32 (and the target's final softcap, if any). Every acceptance decision
  takes the argmax of these fp32 logits (docs/ARCHITECTURE.md, numerics); the fp32 copy is made once per verifier.
- Hybrid targets (linear-attention / recurrent layers) cannot drop a rejected suffix from a recurrent state, so
  `HybridChainVerifier` keeps the model's own cache, snapshots the recurrent states before each forward, and on a
  partial acceptance restores them, crops the attention layers and re-runs the accepted tokens: exact, chain only.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.targets.loading import target_parts
from dflashkit.targets.runtime.graphs import Staging, capture_graph
from dflashkit.targets.runtime.parts import TargetParts, attention_only
from dflashkit.targets.runtime.static_cache import register_attention

from .kv_cache import Compaction, KVCache
from .tree import ancestor_mask
from .tree_attention import tree_attention

ATTENTION_NAME = "tree_attention"


@dataclass
class _Step:
    """What every layer's attention needs during one forward, built once per forward."""
    cache: KVCache
    max_prefix_len: int  # committed tokens before this forward, or (static steps) a bound on them
    causal_prefill: bool  # no prefix and a plain chain: SDPA's causal path
    node_mask: torch.Tensor  # [1, N, N] ancestor mask (uint8 on CUDA for the kernel, bool on CPU)
    node_positions: torch.Tensor  # [1, N] absolute positions (int32 on CUDA)
    prefix_lens: torch.Tensor  # [1] committed tokens (int32 on CUDA)
    slots: torch.Tensor  # [N] cache slots of the nodes (prefix + index)
    backend: str  # tree attention backend: auto, triton, torch


_ACTIVE: list[_Step] = []


def tree_attention_function(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            **kwargs):
    """transformers attention function (registered as "tree_attention"); runs inside TargetVerifier.forward."""
    if not _ACTIVE:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} only runs inside TargetVerifier.forward; "
                           "switch the model back with model.set_attn_implementation('sdpa')")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("eval refuses targets with attention sinks (s_aux, e.g. gpt-oss): its tree "
                                  "attention has no sink term; measure such a drafter through a server")
    step = _ACTIVE[-1]
    keys, values = step.cache.write(module.layer_idx, key, value, step.slots)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if step.causal_prefill and not window and softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    b = query.shape[0]
    out = tree_attention(query, keys, values, step.prefix_lens.expand(b), step.node_mask,
                         step.node_positions.expand(b, -1), scale, window, softcap,
                         max_prefix_len=step.max_prefix_len, backend=step.backend)
    return out, None


def register_tree_attention() -> None:
    register_attention(ATTENTION_NAME, tree_attention_function)


class FP32Head:
    """logits = final hidden state (upcast) @ lm_head weight (fp32 copy), then the target's final softcap."""

    def __init__(self, parts: TargetParts):
        self.weight = parts.lm_head.weight.detach().float()  # the same tensor when the target is fp32
        bias = getattr(parts.lm_head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None
        self.softcap = getattr(parts.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.float(), self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def open_capture(parts: TargetParts, layer_ids: list[int], resources: ExitStack):
    """LayerCapture in hooks-only mode, its hooks on until ``resources`` (the verifier's ExitStack) is closed."""
    from dflashkit.targets.capture import LayerCapture

    return resources.enter_context(LayerCapture(parts, layer_ids, early_exit=False))


class StaticStep:
    """One decode shape (`size` nodes; a chain, or a tree padded to `size`) on static buffers; see the docstring.

    load(...) fills the inputs in place; run() returns (fp32 logits [size, V], features [size, K*H]), the same
    tensors on every call when replayed as a CUDA graph (read them before the next run).
    """

    def __init__(self, verifier: "TargetVerifier", size: int, chain: bool, graph_pool=None):
        device, self.size, self.verifier, self.chain = verifier.device, size, verifier, chain
        self.on_gpu = device.type == "cuda"
        self.use_graph = verifier.cuda_graphs and self.on_gpu
        self.graph_pool = graph_pool
        self.index = torch.arange(size, device=device)
        if chain:  # tokens from the device, a fixed causal mask
            self.input_ids = torch.zeros(1, size, dtype=torch.long, device=device)
            self.prefix = torch.zeros(1, dtype=torch.long, device=device)  # committed tokens, updated in place
            self.depths = self.index
            mask = torch.ones(size, size, dtype=torch.bool, device=device).tril_()
            self.node_mask = mask.unsqueeze(0).to(torch.uint8 if self.on_gpu else torch.bool)
        else:  # tokens, parents, depths and the prefix length in one staged copy: [3 * size + 1]
            self.inputs = Staging(3 * size + 1, torch.long, device)
            self.input_ids = self.inputs.buffer[:size].view(1, size)
            self.parents = self.inputs.buffer[size:2 * size]
            self.depths = self.inputs.buffer[2 * size:3 * size]
            self.prefix = self.inputs.buffer[3 * size:]
        self.graph = None
        self.outputs = None

    def load(self, tokens: torch.Tensor, prefix: int, parents: torch.Tensor | None = None,
             depths: torch.Tensor | None = None) -> None:
        """tokens [n <= size] (a chain: on any device); parents / depths (host tensors) for a tree."""
        n = tokens.shape[-1]
        if self.chain:
            self.input_ids[0, :n].copy_(tokens.view(-1), non_blocking=True)
            self.prefix.fill_(prefix)
            return
        size, host = self.size, self.inputs.write()
        host[:n], host[n:size] = tokens.view(-1), 0
        host[size:size + n], host[size + n:2 * size] = parents.view(-1), -1  # padded nodes: roots of their own
        host[2 * size:2 * size + n], host[2 * size + n:3 * size] = depths.view(-1), 0
        host[3 * size] = prefix
        self.inputs.send()

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.verifier
        positions = (self.depths + self.prefix).view(1, self.size)
        index_dtype, mask_dtype = (torch.int32, torch.uint8) if self.on_gpu else (torch.long, torch.bool)
        node_mask = self.node_mask if self.chain else ancestor_mask(self.parents, self.size - 1).unsqueeze(0)
        step = _Step(v.cache, v.cache.max_len - self.size, False, node_mask.to(mask_dtype), positions.to(index_dtype),
                     self.prefix.to(index_dtype), self.index + self.prefix, v.backend)
        _ACTIVE.append(step)
        try:
            hidden = v.decoder(input_ids=self.input_ids, position_ids=positions, use_cache=False).last_hidden_state
        finally:
            _ACTIVE.pop()
        features, _ = v.capture.features()
        return v.head(hidden[0]), features[0]

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_graph:
            return self._compute()
        if self.graph is None:
            self.graph, self.outputs = capture_graph(self._compute, self.verifier.device, self.graph_pool)
        self.graph.replay()
        return self.outputs


class TargetVerifier:
    """The target with our KV cache and tree attention. Batch 1.

    forward(tokens, parents, depths) runs the nodes and returns (fp32 logits [N or 1, V], features [N, K*H]);
    commit(path) keeps nodes. parents/depths None = a causal chain continuing the committed prefix.
    reserve(n) before a sequence makes room for n cache slots; prepare(shapes) captures the static steps of a run.
    """

    def __init__(self, parts: TargetParts, layer_ids: list[int], backend: str = "auto", cuda_graphs: bool = True):
        parts = target_parts(parts)  # the decoder's parts as they are; a bare HF model (used alone: tests, bench)
        self.parts = parts
        model = parts.model
        if not attention_only(parts):
            raise ValueError(f"{type(model).__name__} has non-attention layers; use HybridChainVerifier")
        register_tree_attention()
        self.model = model
        self.decoder = parts.decoder
        self.head = FP32Head(parts)
        self.backend = backend
        self.cache = KVCache()
        spread = len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1
        self.cuda_graphs = cuda_graphs and not spread  # replay decode steps as CUDA graphs (one CUDA device)
        self.steps: dict[tuple[int, bool], StaticStep] = {}  # (nodes, chain) -> its static step
        self.compactions: dict[int, Compaction] = {}  # nodes of the forward -> its compaction step
        self._graph_pool = None
        self._last_size = 0  # nodes of the last forward (the compaction's shape)
        self.device = next(model.parameters()).device
        # what the verifier changes on the target (capture hooks, the attention implementation), undone by
        # close(); undone at once if building fails half-way
        with ExitStack() as resources:
            self.capture = open_capture(parts, layer_ids, resources)
            resources.callback(model.set_attn_implementation, model.config._attn_implementation)
            model.set_attn_implementation(ATTENTION_NAME)
            self._resources = resources.pop_all()

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def reserve(self, max_len: int) -> None:
        """Room for max_len cache slots. Growing reallocates the cache, so the captured steps go too; rounded up
        to a multiple of 1024 so that a run recaptures rarely."""
        if max_len > self.cache.max_len:
            self.cache.reserve(-(-max_len // 1024) * 1024)
            self.steps.clear()
            self.compactions.clear()

    def _pool(self):
        if self._graph_pool is None and self.cuda_graphs and self.device.type == "cuda":
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _static_step(self, size: int, chain: bool) -> StaticStep:
        if (size, chain) not in self.steps:
            self.steps[size, chain] = StaticStep(self, size, chain, self._pool())
        return self.steps[size, chain]

    def _compaction(self, size: int) -> Compaction:
        if size not in self.compactions:
            self.compactions[size] = Compaction(self.cache, size, self.device,
                                                self.cuda_graphs and self.device.type == "cuda")
        return self.compactions[size]

    @torch.inference_mode()
    def prepare(self, shapes: list[tuple[int, bool]]) -> None:
        """Build (on CUDA: capture) the static steps of these (nodes, chain) shapes, and the compaction of each
        tree shape, before a run, so that no capture lands inside a timed decode. Call it between sequences
        (after reserve, before the prefill): it runs each step once on dummy inputs."""
        self.cache.reset()
        for size, chain in shapes:
            self.cache.check_room(size)
            step = self._static_step(size, chain)
            zeros = torch.zeros(size, dtype=torch.long)
            step.load(zeros, 0, None if chain else zeros - 1, None if chain else zeros)
            step.run()
            if not chain:
                self._compaction(size).run([], 0)
        self.cache.reset()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, parents: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_logits_only: bool = False, pad_to: int | None = None):
        """tokens [N]; parents / depths [N] (host tensors) for a tree, None for a chain continuing the prefix.
        pad_to: run a tree as a static step of this many nodes (the tree budget: one shape, one CUDA graph)."""
        n = tokens.shape[-1]
        if self.cache.length == 0:
            logits, features = self._prefill(tokens, parents, depths)
            self._last_size = n
        else:
            size = max(n, pad_to or 0) if parents is not None else n
            self.cache.check_room(size)
            step = self._static_step(size, parents is None)
            step.load(tokens, self.cache.length, parents, depths)
            logits, features = step.run()
            logits, features = logits[:n], features[:n]
            self._last_size = size
        return (logits[-1:] if last_logits_only else logits), features

    def _prefill(self, tokens, parents, depths):
        """The first forward of a sequence, eagerly (SDPA's causal path for a chain)."""
        n = tokens.shape[-1]
        self.cache.check_room(n)
        if parents is None:
            depths = torch.arange(n, device=self.device)
            node_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        else:
            node_mask = ancestor_mask(parents.to(self.device))
        positions = depths.to(self.device).view(1, n)
        on_gpu = self.device.type == "cuda"
        step = _Step(self.cache, 0, parents is None, node_mask.unsqueeze(0).to(torch.uint8 if on_gpu else torch.bool),
                     positions.to(torch.int32 if on_gpu else torch.long),
                     torch.zeros(1, dtype=torch.int32 if on_gpu else torch.long, device=self.device),
                     torch.arange(n, device=self.device), self.backend)
        _ACTIVE.append(step)
        try:
            hidden = self.decoder(input_ids=tokens.view(1, n).to(self.device), position_ids=positions,
                                  use_cache=False).last_hidden_state
        finally:
            _ACTIVE.pop()
        features, _ = self.capture.features()
        return self.head(hidden[0]), features[0]

    def commit(self, path: list[int]) -> torch.Tensor | None:
        """Keep the nodes `path` (indices into the last forward's nodes) as the next committed tokens. Returns
        their indices on the device when they had to move (a tree path), None when they were the leading nodes
        (a chain) and are in place already."""
        kept = None
        if path != list(range(len(path))):
            kept = self._compaction(self._last_size).run(path, self.cache.length)
        self.cache.length += len(path)
        return kept

    def close(self) -> None:
        """Remove the hooks and give the model its previous attention implementation back."""
        self._resources.close()
