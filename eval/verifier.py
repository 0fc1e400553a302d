"""The target side of speculative decoding: one forward over candidate nodes, then keep the accepted ones.

Design choices:
- The target keeps its own preallocated KV cache (`KVCache`, one [b, Hkv, max_len, d] buffer per layer), plugged
  in through the attention function: the target runs with `use_cache=False` and attention implementation
  "tree_attention" (registered in transformers' AttentionInterface, so every decoder that dispatches through it
  works unchanged). The function writes the layer's new K/V into slots [P, P + N) of our cache and attends with
  the tree kernel. transformers' own Cache classes are never touched, which keeps 5.17 and 5.24 alike.
  (The name has no "flash" in it: transformers treats such names as flash-attention kernels.)
- A forward does not commit: `commit(path)` keeps the listed nodes, copying their K/V to slots P, P+1, ...
  (compaction) and advancing P. Node positions are P + depth, so the kept entries are exactly what an
  autoregressive run over the same tokens would have cached.
- Prefill, autoregressive steps and chain verification are trees too (parents i - 1); a prefill without prefix
  uses SDPA's causal path instead of a dense mask.
- Layer features come from forward hooks on the decoder layers named by target_layer_ids (layer i's output is
  Hugging Face hidden_states[i + 1]).
- Hybrid targets (linear-attention / recurrent layers) cannot drop a rejected suffix from a recurrent state, so
  `HybridChainVerifier` keeps the model's own cache, snapshots the recurrent states before each forward, and on a
  partial acceptance restores them, crops the attention layers and re-runs the accepted tokens: exact, chain only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .tree_attention import tree_attention

ATTENTION_NAME = "tree_attention"
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class KVCache:
    """Preallocated per-layer K/V of one batch of sequences; slots [0, length) are committed."""

    def __init__(self, max_len: int):
        self.max_len = max_len  # slots per layer (prompt + new tokens + one round of nodes)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0  # committed tokens

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this round's K/V [b, Hkv, N, d] at slots [length, length + N); return the whole buffers."""
        if layer not in self.keys:
            b, hkv, _, d = key.shape
            self.keys[layer] = key.new_zeros(b, hkv, self.max_len, d)
            self.values[layer] = value.new_zeros(b, hkv, self.max_len, value.shape[-1])
        n = key.shape[2]
        if self.length + n > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots is full ({self.length} kept + {n} new); "
                               "raise max_len (prompt length + max_new_tokens + tree budget)")
        self.keys[layer][:, :, self.length:self.length + n] = key
        self.values[layer][:, :, self.length:self.length + n] = value
        return self.keys[layer], self.values[layer]

    def commit(self, path: list[int]) -> None:
        """Keep the nodes `path` (indices into the last forward's nodes) as the next committed tokens."""
        if path != list(range(len(path))):  # a chain prefix is already in place
            index = torch.tensor(path, device=next(iter(self.keys.values())).device) + self.length
            for cache in (*self.keys.values(), *self.values.values()):
                cache[:, :, self.length:self.length + len(path)] = cache.index_select(2, index)
        self.length += len(path)

    def reset(self) -> None:
        self.length = 0


@dataclass
class _Step:
    """What every layer's attention needs during one forward, built once per forward."""
    cache: KVCache
    prefix_len: int  # committed tokens before this forward
    causal_prefill: bool  # no prefix and a plain chain: SDPA's causal path
    node_mask: torch.Tensor  # [1, N, N] ancestor mask (uint8 on CUDA for the kernel, bool on CPU)
    node_positions: torch.Tensor  # [1, N] absolute positions (int32 on CUDA)
    prefix_lens: torch.Tensor  # [1] = prefix_len
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
    keys, values = step.cache.write(module.layer_idx, key, value)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if step.causal_prefill and not window and softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    b = query.shape[0]
    out = tree_attention(query, keys, values, step.prefix_lens.expand(b), step.node_mask,
                         step.node_positions.expand(b, -1), scale, window, softcap, max_prefix_len=step.prefix_len,
                         backend=step.backend)
    return out, None


def register_tree_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_function)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layer list (layer i's output is Hugging Face hidden_states[i + 1])."""
    from dflashkit.target.loading import find_decoder

    return find_decoder(model).layers


def is_hybrid(model: nn.Module) -> bool:
    """True when some decoder layers are not attention (linear attention, Mamba, short convolutions)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None) or []
    return any(t not in ATTENTION_LAYER_TYPES for t in layer_types)


class _FeatureTap:
    """Forward hooks on the tapped decoder layers; `take()` returns [N, K*H] of the last forward."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id):
        def hook(_module, _args, output):
            self.outputs[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def take(self) -> torch.Tensor | None:
        if not self.layer_ids:
            return None
        features = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return features[0]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class TargetVerifier:
    """The target with our KV cache and tree attention. Batch 1.

    forward(tokens, parents, depths) runs the nodes and returns (logits [N or 1, V], features [N, K*H]);
    commit(path) keeps nodes. parents/depths None = a causal chain continuing the committed prefix.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], max_len: int, backend: str = "auto"):
        if is_hybrid(model):
            raise ValueError(f"{type(model).__name__} has non-attention layers; use HybridChainVerifier")
        register_tree_attention()
        self.model = model
        self.backend = backend
        self.cache = KVCache(max_len)
        self.tap = _FeatureTap(model, layer_ids)
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        self.device = next(model.parameters()).device

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, parents: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_logits_only: bool = False, max_depth: int | None = None):
        """max_depth: the tree's depth, when depths live on the GPU (saves a device sync; CUDA-graph safe)."""
        from .tree import ancestor_mask

        n = tokens.shape[-1]
        prefix = self.cache.length
        if parents is None:  # a causal chain
            depths = torch.arange(n, device=self.device)
            node_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        else:
            max_depth = int(depths.max()) if max_depth is None else max_depth
            node_mask = ancestor_mask(parents.to(self.device), max_depth=max_depth)
        positions = (depths.to(self.device) + prefix).view(1, n)
        on_gpu = self.device.type == "cuda"
        step = _Step(self.cache, prefix, parents is None and prefix == 0,
                     node_mask.unsqueeze(0).to(torch.uint8 if on_gpu else torch.bool),
                     positions.to(torch.int32 if on_gpu else torch.long),
                     torch.full((1,), prefix, dtype=torch.int32 if on_gpu else torch.long, device=self.device),
                     self.backend)
        _ACTIVE.append(step)
        try:
            out = self.model(input_ids=tokens.view(1, n).to(self.device), position_ids=positions, use_cache=False,
                             logits_to_keep=1 if last_logits_only else 0)
        finally:
            _ACTIVE.pop()
        return out.logits[0], self.tap.take()

    def commit(self, path: list[int]) -> None:
        self.cache.commit(path)

    def close(self) -> None:
        """Remove the hooks and give the model its previous attention implementation back."""
        self.tap.remove()
        self.model.set_attn_implementation(self._previous_attention)
