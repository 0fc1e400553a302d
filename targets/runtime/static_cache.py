"""The static K/V cache of the runtime, and how an attention function of ours is plugged into a Hugging Face model.

Used by the slot generator (extract/generation/slot_cache.py: a row per slot), the verifier (eval/kv_cache.py: one
sequence, slots committed in order) and the drafter's static pass (eval/draft_step.py); each keeps only its layout.

Design choices:
- ``StaticKV``: per layer, one K and one V buffer ``[rows, kv_heads, max_len, head_dim]``, allocated on the
  layer's first write with the shape of its key (so every attention layer of any decoder fits, whatever its
  head count or head size), zero-filled, and written in place: ``write`` at the same slots of every row (a
  verify step, a drafter pass), ``write_columns`` at one column per row (a decode step of the slot generator).
  Static buffers are what a CUDA graph needs: their addresses never change while the cache lives.
- A cache too large for the device fails with one line that says what to lower, not an out-of-memory traceback.
- Our attention functions reach the model through transformers' ``AttentionInterface`` (``register_attention``);
  ``AttentionSwitch`` points every config of the model at one of them and back, so the model's own forward (rope,
  norms, MoE, sliding windows) runs unchanged around our cache.
"""

from __future__ import annotations

import torch
from torch import nn

from dflashkit.errors import UserError


class StaticKV:
    """Per-layer K/V buffers [rows, kv_heads, max_len, head_dim], allocated at each layer's first write."""

    def __init__(self, max_len: int, rows: int | None = None, fix: str = "reserve fewer tokens"):
        self.max_len = max_len  # slots per row
        self.rows = rows  # rows per buffer (None: the batch of the first write)
        self.fix = fix  # what the user can lower when the buffers do not fit (the end of the error message)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def buffers(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers, allocated now if this is its first write (shaped after key / value)."""
        if layer not in self.keys:
            rows = key.shape[0] if self.rows is None else self.rows
            try:
                self.keys[layer] = key.new_zeros(rows, key.shape[1], self.max_len, key.shape[3])
                self.values[layer] = value.new_zeros(rows, value.shape[1], self.max_len, value.shape[3])
            except torch.cuda.OutOfMemoryError:
                self.clear()
                raise UserError(f"the KV cache of {rows} x {self.max_len} tokens does not fit on {key.device}: "
                                f"{self.fix}") from None
        return self.keys[layer], self.values[layer]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key / value [rows, kv_heads, N, d] at `slots` ([N], a device tensor) of every row; return the
        whole buffers."""
        keys, values = self.buffers(layer, key, value)
        keys.index_copy_(2, slots, key)
        values.index_copy_(2, slots, value)
        return keys, values

    def write_columns(self, layer: int, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                      columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one token per row, key / value [R, kv_heads, 1, d], at (rows[r], columns[r]); return the whole
        buffers."""
        keys, values = self.buffers(layer, key, value)
        keys[rows, :, columns] = key[:, :, 0]
        values[rows, :, columns] = value[:, :, 0]
        return keys, values

    def clear(self) -> None:
        """Drop every buffer (the next write allocates again)."""
        self.keys.clear()
        self.values.clear()


def register_attention(name: str, function) -> None:
    """Make `function` (transformers' attention signature) available to models as attention implementation `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


class AttentionSwitch:
    """Every config of `model` that names an attention implementation, pointed at another one and back."""

    def __init__(self, model: nn.Module):
        configs = [model.config, *(getattr(m, "config", None) for m in model.modules())]
        self.configs = list({id(c): c for c in configs if c is not None and hasattr(c, "_attn_implementation")}
                            .values())

    def set(self, names: str | list[str]) -> list[str]:
        """Point every config at `names` (one name, or one per config, as `set` returned them); return the old."""
        old = [c._attn_implementation for c in self.configs]
        for config, name in zip(self.configs, names if isinstance(names, list) else [names] * len(self.configs)):
            config._attn_implementation = name
        return old
