"""Decode attention over a slot cache: one query token per slot, each slot reading only its own columns.

Layout (what the slot generator's attention function receives in a decode step):
- query [slots, Hq, 1, d]; key / value [slots, Hkv, S, d] (the layer's cache, any strides with d contiguous);
  Hq = group * Hkv (GQA: query head h reads K/V head h // group).
- positions [slots] (int): slot b attends to cache columns 0..positions[b] (inclusive), and with a sliding
  window only to the last `window` of them (columns > positions[b] - window).
- output [slots, 1, Hq, d], the layout attention functions return.

Design choices:
- The Triton kernel (decode_attention_triton.py) is flash-decoding: programs over (slot, K/V head, split of the
  columns); each loads its GQA group of queries once and streams its slot's K/V up to that slot's own position,
  so a step reads the live lengths, not the longest slot's length for every slot. Splits are merged by
  log-sum-exp in a second small kernel (none when one split per slot fills the GPU).
- The positions come from a device tensor, so a captured step serves any positions below the attended length.
- The twin below is plain float32 PyTorch (the CPU path and the kernel's test oracle). Attention sinks and logit
  soft-capping are not handled here: the generator keeps its own path for such layers.
"""

from __future__ import annotations

import torch

from dflashkit.targets.runtime.kernels import triton_available


def decode_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                               scale: float, window: int | None = None) -> torch.Tensor:
    """The plain-PyTorch twin (float32 softmax). Shapes as in the module docstring."""
    b, hq, _, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    group = hq // hkv
    cols = torch.arange(s, device=query.device)[None, :]
    pos = positions.to(query.device).long()[:, None]
    visible = cols <= pos
    if window:
        visible &= cols > pos - window
    q = query.float().reshape(b, hkv, group, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [b, hkv, group, s]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [b, hkv, group, d]
    return out.reshape(b, 1, hq, d).to(query.dtype)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """The Triton kernel where it can run (see triton_available), else the twin."""
    if triton_available(query.device):
        from .decode_attention_triton import decode_attention_triton

        return decode_attention_triton(query, key, value, positions, scale, window)
    return decode_attention_reference(query, key, value, positions, scale, window)
