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
- Layer features come from dflashkit.target.capture.LayerCapture in its hooks-only mode (early_exit=False): the
  one capture implementation, so eval reads exactly what extraction and training read (layer i's output is
  Hugging Face hidden_states[i + 1]; layer L - 1 is the final-norm output).
- Logits are computed here, not by the model: the decoder's final hidden state (after the final norm) times an
  fp32 copy of the lm_head weight, in fp32 (and the target's final softcap, if any). Every acceptance decision
  takes the argmax of these fp32 logits (DESIGN.md, numerics); the fp32 copy is made once per verifier.
- Hybrid targets (linear-attention / recurrent layers) cannot drop a rejected suffix from a recurrent state, so
  `HybridChainVerifier` keeps the model's own cache, snapshots the recurrent states before each forward, and on a
  partial acceptance restores them, crops the attention layers and re-runs the accepted tokens: exact, chain only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .tree_attention import tree_attention

ATTENTION_NAME = "tree_attention"
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class KVCache:
    """Preallocated per-layer K/V of one batch of sequences; slots [0, length) are committed."""

    def __init__(self, max_len: int = 0):
        self.max_len = max_len  # slots per layer (prompt + new tokens + one round of nodes)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0  # committed tokens

    def reserve(self, max_len: int) -> None:
        """Make room for max_len slots (buffers are reallocated on the next write when they grow; reset first)."""
        if max_len > self.max_len:
            self.max_len = max_len
            self.keys.clear()
            self.values.clear()
            self.length = 0

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
        raise NotImplementedError("tree attention does not support attention sinks (s_aux); this target cannot "
                                  "be verified with it")
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


def capture_parts(model: nn.Module) -> SimpleNamespace:
    """What dflashkit.target.capture.LayerCapture needs of a target, for a bare Hugging Face model."""
    from dflashkit.target.loading import find_decoder

    decoder = find_decoder(model)
    return SimpleNamespace(model=model, layers=decoder.layers, final_norm=decoder.norm,
                           num_layers=len(decoder.layers))


class FP32Head:
    """logits = final hidden state (upcast) @ lm_head weight (fp32 copy), then the target's final softcap."""

    def __init__(self, model: nn.Module):
        lm_head = model.get_output_embeddings()
        self.weight = lm_head.weight.detach().float()  # the same tensor when the target is fp32
        bias = getattr(lm_head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.float(), self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def open_capture(model: nn.Module, layer_ids: list[int]):
    """LayerCapture in hooks-only mode, entered (hooks on); leave it with .__exit__()."""
    from dflashkit.target.capture import LayerCapture

    return LayerCapture(capture_parts(model), layer_ids, early_exit=False).__enter__()


class TargetVerifier:
    """The target with our KV cache and tree attention. Batch 1.

    forward(tokens, parents, depths) runs the nodes and returns (fp32 logits [N or 1, V], features [N, K*H]);
    commit(path) keeps nodes. parents/depths None = a causal chain continuing the committed prefix.
    reserve(n) before a sequence makes room for n cache slots.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], backend: str = "auto"):
        if is_hybrid(model):
            raise ValueError(f"{type(model).__name__} has non-attention layers; use HybridChainVerifier")
        from dflashkit.target.loading import find_decoder

        register_tree_attention()
        self.model = model
        self.decoder = find_decoder(model)
        self.head = FP32Head(model)
        self.backend = backend
        self.cache = KVCache()
        self.capture = open_capture(model, layer_ids)
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        self.device = next(model.parameters()).device

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def reserve(self, max_len: int) -> None:
        self.cache.reserve(max_len)

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
            hidden = self.decoder(input_ids=tokens.view(1, n).to(self.device), position_ids=positions,
                                  use_cache=False).last_hidden_state
        finally:
            _ACTIVE.pop()
        features, _ = self.capture.features()
        return self.head(hidden[0, -1:] if last_logits_only else hidden[0]), features[0]

    def commit(self, path: list[int]) -> None:
        self.cache.commit(path)

    def close(self) -> None:
        """Remove the hooks and give the model its previous attention implementation back."""
        self.capture.__exit__(None, None, None)
        self.model.set_attn_implementation(self._previous_attention)
