"""Tree attention for the verification forward: a Triton kernel and its plain-PyTorch twin.

Layout (the one the target's attention modules hand to an attention function, plus our cache):
- query [b, H, N, d]: one row per candidate node (N nodes per sequence, same N for the batch).
- key / value [b, Hkv, S, d]: slots [0, P_b) hold the committed prefix of sequence b, slots [P_b, P_b + N) the
  nodes of this round (written before the call); anything beyond is ignored. H = group * Hkv (GQA).
- node_mask bool [b or 1, N, N]: node i sees node j (j is i or an ancestor of i).
- node_positions [b, N]: absolute positions (P_b + depth); used only for sliding windows.
- output [b, N, H, d], the layout attention functions return.

Design choices:
- Every node sees the whole prefix, so the prefix part needs no mask at all: the kernel splits the prefix into
  chunks (split-K, as in flash-decoding) so that short batches still fill the GPU, and gives the N node keys
  their own split, the only one that reads the ancestor mask.
- All G query heads that share a KV head are packed into the rows of one tile, so each K/V tile is loaded once
  for the whole group.
- Each split writes an unnormalised partial (m, l, acc) in fp32; a second small kernel merges them.
- Softcapping (Gemma 2) and sliding windows are handled in both paths; tanh is written with exp so that the
  interpreter and every Triton version accept it.
- The twin builds the dense boolean mask and calls SDPA (or plain math with a softcap). It is the CPU path and
  the oracle of the kernel's tests; the kernel also runs on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflashkit.targets.runtime.kernels import triton_available


def dense_visibility(prefix_lens: torch.Tensor, node_mask: torch.Tensor, node_positions: torch.Tensor,
                     num_keys: int, sliding_window: int | None = None) -> torch.Tensor:
    """Bool [b, N, S]: which key slot each node sees (prefix, then its ancestors and itself)."""
    b, n = node_positions.shape
    node_mask = node_mask.bool()
    slot = torch.arange(num_keys, device=node_positions.device).view(1, 1, -1)
    prefix = prefix_lens.view(b, 1, 1).to(slot.device)
    in_prefix = slot < prefix
    node_j = slot - prefix
    in_nodes = (node_j >= 0) & (node_j < n)
    tree = torch.gather(node_mask.expand(b, n, n), 2, node_j.clamp(0, n - 1).expand(b, n, num_keys))
    visible = in_prefix | (in_nodes & tree)
    if sliding_window:
        key_pos = torch.where(in_prefix, slot, torch.gather(node_positions, 1, node_j.clamp(0, n - 1).view(b, -1))
                              .view(b, 1, -1))
        visible &= (node_positions.unsqueeze(-1) - key_pos) < sliding_window
    return visible


def tree_attention_reference(query, key, value, prefix_lens, node_mask, node_positions, scale: float,
                             sliding_window: int | None = None, softcap: float | None = None,
                             max_prefix_len: int | None = None) -> torch.Tensor:
    """The plain-PyTorch twin (CPU path and test oracle). Shapes as in the module docstring."""
    b, h, n, _ = query.shape
    max_prefix_len = int(prefix_lens.max()) if max_prefix_len is None else max_prefix_len
    num_keys = min(key.shape[2], max_prefix_len + n)
    key, value = key[:, :, :num_keys], value[:, :, :num_keys]
    group = h // key.shape[1]
    visible = dense_visibility(prefix_lens, node_mask, node_positions, num_keys, sliding_window).unsqueeze(1)
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale,
                                             enable_gqa=group > 1)
    else:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)
    return out.transpose(1, 2)


def tree_attention(query, key, value, prefix_lens, node_mask, node_positions, scale: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None,
                   max_prefix_len: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Dispatch: the Triton kernel where it runs (CUDA, or the interpreter), else the PyTorch twin.

    backend: "auto", "triton" or "torch".
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"tree attention backend must be auto, triton or torch, got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and query.device.type == "cuda"
                                         and triton_available(query.device))
    if use_triton:
        if not triton_available(query.device):
            raise RuntimeError("tree attention backend 'triton' needs triton and a CUDA device "
                               "(or TRITON_INTERPRET=1); install triton or use backend='torch'")
        from .tree_attention_triton import tree_attention_triton

        return tree_attention_triton(query, key, value, prefix_lens, node_mask, node_positions, scale,
                                     sliding_window, softcap, max_prefix_len)
    return tree_attention_reference(query, key, value, prefix_lens, node_mask, node_positions, scale,
                                    sliding_window, softcap, max_prefix_len)
