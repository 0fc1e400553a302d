"""Chain verification for hybrid targets (linear-attention, Mamba or convolution layers beside attention).

Design choices:
- A recurrent state cannot forget the rejected suffix of a block, so before each forward the recurrent and
  convolution states of every such layer are cloned. If the whole block is accepted nothing more happens. If
  only a prefix is, the states are put back, the attention layers are cropped to the old length, and the
  accepted tokens are run again: the cache is then exactly what autoregressive decoding would have built.
- The model keeps its own transformers cache (DynamicCache built from its config, which knows the layer kinds)
  and its own attention implementation; a chain needs only the causal mask.
- Trees are refused: each branch would need its own recurrent state.
- Features and logits as in TargetVerifier: LayerCapture (hooks-only) and fp32 logits from the final hidden state.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from dflashkit.targets.loading import target_parts
from dflashkit.targets.runtime.parts import TargetParts

from .verifier import FP32Head, open_capture

TREE_REFUSAL = ("tree verification is not supported for hybrid targets (linear-attention or recurrent layers "
                "hold one state per sequence, not per branch); use --mode chain")


def _cache_kwargs(model: nn.Module, cache) -> dict:
    from dflashkit.targets.loading import cache_kwargs

    return cache_kwargs(model, cache)


def _state_layers(cache):
    return [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]


def snapshot_states(cache) -> list[dict]:
    """Clones of every recurrent / convolution state in a transformers hybrid cache."""
    snapshot = []
    for layer in _state_layers(cache):
        snapshot.append({
            "conv_states": {k: (v.clone() if v is not None else None) for k, v in layer.conv_states.items()},
            "recurrent_states": {k: (v.clone() if v is not None else None)
                                 for k, v in layer.recurrent_states.items()},
            "flags": {name: dict(getattr(layer, name)) for name in
                      ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")
                      if hasattr(layer, name)},
        })
    return snapshot


def restore_states(cache, snapshot: list[dict]) -> None:
    for layer, saved in zip(_state_layers(cache), snapshot):
        layer.conv_states = dict(saved["conv_states"])
        layer.recurrent_states = dict(saved["recurrent_states"])
        for name, value in saved["flags"].items():
            setattr(layer, name, dict(value))


def crop_attention_layers(cache, tokens_to_remove: int) -> None:
    """Drop the last `tokens_to_remove` K/V entries of every attention layer (recurrent states untouched)."""
    from transformers.cache_utils import DynamicLayer

    if tokens_to_remove == 0:
        return
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None:
            DynamicLayer.crop(layer, -tokens_to_remove)


class HybridChainVerifier:
    """Same interface as TargetVerifier (forward / commit / length / reset / reserve / prepare / close), chains
    only; commit returns None (the kept nodes are always the leading ones); eager
    (the model's own cache grows and is cropped, so its steps are not captured as CUDA graphs)."""

    def __init__(self, parts: TargetParts, layer_ids: list[int]):
        parts = target_parts(parts)  # the decoder's parts as they are; a bare HF model (used alone: tests)
        self.parts = parts
        self.model = parts.model
        self.decoder = parts.decoder
        self.head = FP32Head(parts)
        self._resources = ExitStack()  # the capture hooks, removed by close()
        self.capture = open_capture(parts, layer_ids, self._resources)
        self.device = next(self.model.parameters()).device
        self.cache = None
        self._length = 0
        self._pending: tuple[torch.Tensor, list[dict]] | None = None

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self._length = 0
        self._pending = None

    def reserve(self, max_len: int) -> None:
        """The model's own cache grows as it goes: nothing to reserve."""

    def prepare(self, shapes: list[tuple[int, bool]]) -> None:
        """Eager steps: nothing to capture before a run."""

    def _run(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden state [N, H] of the tokens, continuing the cache."""
        n = tokens.shape[-1]
        positions = torch.arange(self._length, self._length + n, device=self.device).view(1, n)
        return self.decoder(input_ids=tokens.view(1, n).to(self.device), position_ids=positions, use_cache=True,
                            **_cache_kwargs(self.decoder, self.cache)).last_hidden_state[0]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, parents: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_logits_only: bool = False, pad_to: int | None = None):
        n = tokens.shape[-1]
        if parents is not None and parents.tolist() != list(range(-1, n - 1)):
            raise ValueError(TREE_REFUSAL)
        if self.cache is None:
            self.reset()
        self._pending = (tokens, snapshot_states(self.cache))
        hidden = self._run(tokens)
        features, _ = self.capture.features()
        return self.head(hidden[-1:] if last_logits_only else hidden), features[0]

    @torch.inference_mode()
    def commit(self, path: list[int]) -> None:
        tokens, snapshot = self._pending
        self._pending = None
        n, kept = tokens.shape[-1], len(path)
        if path != list(range(kept)):
            raise ValueError(TREE_REFUSAL)
        if kept < n:  # roll back to before the forward, then run the accepted prefix again
            restore_states(self.cache, snapshot)
            crop_attention_layers(self.cache, n)
            if kept:
                self._run(tokens[..., :kept])
                self.capture.features()
        self._length += kept

    def close(self) -> None:
        self._resources.close()
