"""DFlash block drafter: a few Qwen3-style layers that attend to target features and draft a block at once.

This file is self-contained (torch + transformers only): the export copies it next to the weights, so
``AutoModel.from_pretrained(dir, trust_remote_code=True)`` loads the drafter with no dflashkit installed, and
its ``forward`` takes the reference's arguments (position_ids, noise_embedding, target_hidden,
past_key_values, use_cache) and returns the same tensor.

How one pass works (B = block size, C = context tokens, K = number of tapped target layers):
- target_hidden [b, C, K*H] (the tapped target layer outputs, concatenated) -> fc -> RMSNorm = context states.
- noise_embedding [b, Q, H] = the target's embedding of [anchor, MASK x (B-1)] = the block states.
- every layer: Q from the block states; K/V = concat(k/v_proj(context), k/v_proj(block)); per-head q/k RMSNorm;
  RoPE at the given positions (context first, then block); then SwiGLU MLP; pre-norm residuals.
- full-attention layers are non-causal (the block sees every context key and the whole block); sliding layers
  are causal over the key index and see a window of keys, as in the reference.
- the output is normalised by ``norm``; logits come from the target's lm_head (the drafter owns none).

attention_mask may be a bool tensor (True = may attend) broadcastable to [b, 1, Q, C+Q], a dict keyed by layer
type, or a flex_attention BlockMask (training packs many blocks into one pass and supplies its own masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def dflash_field(config, name, default=None):
    """DFlash settings live under ``dflash_config`` or at the top level of the config."""
    sub = getattr(config, "dflash_config", None) or {}
    value = sub.get(name) if isinstance(sub, dict) else None
    return value if value is not None else getattr(config, name, default)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def sliding_mask(q_len: int, k_len: int, window: int, device) -> torch.Tensor:
    """Causal over the key index with a window: query i (key index k_len-q_len+i) sees key j iff
    j <= that index and index - j < window. Matches the reference's decode-time default."""
    qi = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    kj = torch.arange(k_len, device=device)[None, :]
    return ((kj <= qi) & (qi - kj < window))[None, None]


_FLEX = []  # the compiled flex_attention, built on first use (eager flex_attention is a slow reference path)


def attend(q, k, v, mask, scale):
    """SDPA with a bool/float mask, or flex_attention with a BlockMask (CUDA training)."""
    if type(mask).__name__ == "BlockMask":
        if not _FLEX:
            from torch.nn.attention.flex_attention import flex_attention

            _FLEX.append(torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention)
        return _FLEX[0](q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        self.layer_type = types[layer_idx] if types else "full_attention"
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None

    def forward(self, block, context, cos, sin, attention_mask=None, past_key_values=None):
        b, q_len, _ = block.shape
        c_len = context.shape[1]
        q = self.q_norm(self.q_proj(block).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(block)], dim=1).view(b, c_len + q_len, -1, self.head_dim)
        v = torch.cat([self.v_proj(context), self.v_proj(block)], dim=1).view(b, c_len + q_len, -1, self.head_dim)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, C+Q, d]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        mask = attention_mask
        if isinstance(mask, dict):
            mask = mask.get(self.layer_type)
        if mask is None and self.sliding_window is not None:
            mask = sliding_mask(q_len, k.shape[2], self.sliding_window, q.device)
        out = attend(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block, context, cos, sin, attention_mask=None, past_key_values=None):
        block = block + self.self_attn(self.input_layernorm(block), context, cos, sin, attention_mask,
                                       past_key_values)
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.target_layer_ids = [int(i) for i in dflash_field(config, "target_layer_ids")]
        self.block_size = int(dflash_field(config, "block_size", 16))
        self.mask_token_id = dflash_field(config, "mask_token_id")
        self.input_embedding_scale = float(dflash_field(config, "input_embedding_scale", 1.0))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        else:  # the base class recomputes RoPE tables, which from_pretrained leaves uninitialised
            super()._init_weights(module)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the K tapped layers: [.., K*H] -> fc -> RMSNorm -> [.., H]."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs):
        block = noise_embedding
        context = self.project_context(target_hidden.to(self.fc.weight.dtype))
        cos, sin = self.rotary_emb(block, position_ids)
        cache = past_key_values if (use_cache or past_key_values is not None) else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                block = torch.utils.checkpoint.checkpoint(layer, block, context, cos, sin, attention_mask,
                                                          None, use_reentrant=False)
            else:
                block = layer(block, context, cos, sin, attention_mask, cache)
        return self.norm(block)

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(hidden)
