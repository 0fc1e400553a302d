"""The slot generator's K/V cache and the attention function it registers with transformers
(extract/generation/generator.py drives both).

- ``SlotCache`` holds, per layer, K and V for a fixed number of slots, written at explicit (slot, column) places:
  the runtime's static cache (targets/runtime/static_cache.py) with a row per slot.
- ``slot_attention`` (registered as ``ATTENTION_NAME``): prefill through the library's SDPA; a decode step
  through ``grouped_attention`` (each K/V head's group of query heads as its queries, one fused SDPA call, our
  own float32-softmax form for attention sinks or soft-capping), or, when the step passes ``slot_decode``, the
  decode kernel of decode_attention.py for layers without sinks or soft-capping.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflashkit.targets.runtime.static_cache import StaticKV, register_attention

from .decode_attention import decode_attention

ATTENTION_NAME = "dflashkit_slots"


class SlotCache(StaticKV):
    """The runtime's static K/V with a row per slot, written at explicit (slot, column) places; the model calls
    ``update`` per layer.

    ``prefill(slots, shift)``: the forward holds len(slots) left-padded prompts; row b's token t belongs in
    column t - shift[b]. ``decode(columns)``: the forward holds one token per slot, written at columns[slot]."""

    def __init__(self, num_slots: int, max_length: int):
        super().__init__(max_length, rows=num_slots,
                         fix="lower --batch-size or --max-prompt-length / --max-new-tokens")
        self.num_slots, self.max_length = num_slots, max_length
        self._slots = self._shift = self._columns = None
        self._length = max_length

    def prefill(self, slots: torch.Tensor, shift: torch.Tensor) -> None:
        self._slots, self._shift, self._columns = slots, shift, None

    def decode(self, columns: torch.Tensor, length: int) -> None:
        """Attention reads columns 0..length-1 (every live slot's position is below `length`)."""
        self._slots = self._shift = None
        self._columns, self._length = columns, length
        self._rows = torch.arange(columns.shape[0], device=columns.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some forwards when position ids are absent
        return 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._columns is not None:  # one new token per slot; attention reads the columns below _length
            k_all, v_all = self.write_columns(layer_idx, key, value, self._rows, self._columns)
            return k_all[:, :, : self._length], v_all[:, :, : self._length]
        k_all, v_all = self.buffers(layer_idx, key, value)
        width = key.shape[2]  # prefill: roll each row left by its padding, store columns 0..width-1
        src = (torch.arange(width, device=key.device)[None, :] + self._shift[:, None]).clamp(max=width - 1)
        src = src[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        k_all[self._slots, :, :width] = key.gather(2, src)
        v_all[self._slots, :, :width] = value.gather(2, src)
        return key, value  # prefill attends within the prompts only


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with K/V heads shared by groups of query heads, without repeating K/V.

    query [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B, 1, T, S]: bool (True: attend) or
    additive (0 / -inf)
    Handles attention sinks (``module.sinks``, one logit per query head) and logit soft-capping."""
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    q = query.reshape(b, hkv, g * t, d)  # query head h uses K/V head h // g
    sinks = getattr(module, "sinks", None)
    if t == 1 and sinks is None and kwargs.get("softcap") is None:  # one fused kernel; the G heads act as queries
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, hq, t, d).transpose(1, 2).contiguous(), None
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (scaling if scaling is not None else d ** -0.5)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask[:, :, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1).reshape(b, hkv, g * t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(value.dtype), value)  # [B, Hkv, G*T, D]
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous(), None


class SlotDecode(NamedTuple):
    """What the decode kernel needs besides the tensors: every slot's position (its cache column; it reads
    columns 0..position) and each layer's sliding window (None: full attention), by layer index. The layers that
    ran the kernel are added to `kernel_layers` (on a GPU: while the step is traced, not when it is replayed)."""

    positions: torch.Tensor
    windows: tuple
    kernel_layers: set


def slot_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function the model runs while a SlotGenerator drives it (registered as ATTENTION_NAME)."""
    decode = kwargs.pop("slot_decode", None)
    layer = getattr(module, "layer_idx", None)
    if (decode is not None and query.shape[2] == 1 and layer is not None and layer < len(decode.windows)
            and getattr(module, "sinks", None) is None and kwargs.get("softcap") is None):
        scaling = kwargs.get("scaling")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        decode.kernel_layers.add(layer)
        return decode_attention(query, key, value, decode.positions, scale, decode.windows[layer]), None
    if query.shape[2] > 1 and getattr(module, "sinks", None) is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs.pop("softcap", None)
        kwargs.pop("sliding_window", None)
        kwargs.pop("s_aux", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return grouped_attention(module, query, key, value, attention_mask, **kwargs)


def register_slot_attention() -> None:
    register_attention(ATTENTION_NAME, slot_attention)
