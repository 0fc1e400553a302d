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
  are causal over the key index and see a window of keys, as in the reference. A config ``is_causal`` makes
  every layer causal (True) or non-causal with a two-sided window (False), as the reference reads it.
- the output is normalised by ``norm``; logits come from the target's lm_head (the drafter owns none), times
  ``output_multiplier`` and soft-capped by ``final_logit_softcapping`` when the config sets them.
- ``spec_generate`` decodes with a target (HF model) the way the reference's ``spec_generate`` does: greedy or
  sampled, one block per round, verified by the target.
- A config that asks for what this file does not implement (another drafter architecture, attention sinks,
  an unknown activation or layer type) is refused when the model is built.

attention_mask may be a bool tensor (True = may attend) broadcastable to [b, 1, Q, C+Q], a dict keyed by layer
type, a flex_attention BlockMask, or an object with ``attend(q, k, v, scale)`` that computes the attention
itself (training packs many blocks into one pass and supplies its own masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")
# reference-format fields this file does not implement: a config that sets them is refused, never ignored
UNSUPPORTED = {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0,
               "attention_sink_bias": False, "projector_type": None, "use_swa": False}


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


def default_mask(q_len: int, k_len: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """Query i sits at key index k_len-q_len+i. Causal: it sees keys j <= that index; a window keeps keys with
    index - j < window (and, when not causal, j - index < window too). Matches the reference's default."""
    qi = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    kj = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= kj <= qi
    if window is not None:
        visible &= qi - kj < window
        if not causal:
            visible &= kj - qi < window
    return visible[None, None]


_FLEX = []  # the compiled flex_attention, built on first use (eager flex_attention is a slow reference path)
# flex_attention's tile on both axes, the project's one copy of it (train/ imports it: block masks, packing);
# training packs are padded to multiples of it
FLEX_TILE = 128


def autocast_inputs(q, k, v):
    """q, k, v in the autocast dtype while autocast is on for their device, else unchanged.

    Mixed-precision training keeps fp32 weights under autocast, so RMSNorm's weight hands q and k over in float32
    while v (a linear's output) is bf16. Autocast casts SDPA's inputs itself; eager flex_attention and the split
    attention's own matmuls would compute in float32, unlike the SDPA path. (In the compiled CUDA training layer
    the flex kernel took the same time with and without this cast.)"""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


def flex_attention_for(cuda: bool):
    """The flex_attention that ``attend`` runs (compiled on CUDA), built at the first call. Call it before any
    compiled layer runs (train/drafter_pass.compile_layers does): built inside a traced layer, the list it fills
    becomes a guard that the next call fails, and the layer compiled again (a recompilation per run on the GPU,
    ``TORCH_LOGS=recompiles``: ``not G['_FLEX']``)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False) if cuda else flex_attention)
    return _FLEX[0]


def attend(q, k, v, mask, scale):
    """SDPA with a bool/float mask, flex_attention with a BlockMask (CUDA training), or the mask's own attend."""
    if mask is not None and not torch.is_tensor(mask):  # flex_attention or the mask's own: autocast's dtype
        q, k, v = autocast_inputs(q, k, v)
    if type(mask).__name__ == "BlockMask":
        flex = flex_attention_for(q.is_cuda)
        # Training packs are padded to multiples of flex_attention's 128-token tile (train/data.PAD_MULTIPLE). In a
        # layer compiled for dynamic shapes the kernels cannot see that and keep their bounds checks; this test
        # becomes a guard of the compiled graph, and the option lets the kernels drop them, as for static shapes.
        aligned = q.is_cuda and q.shape[2] % FLEX_TILE == 0 and k.shape[2] % FLEX_TILE == 0
        opts = {"IS_DIVISIBLE": True} if aligned else None
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                        kernel_options=opts)
    if mask is not None and not torch.is_tensor(mask):  # a mask object that attends itself
        return mask.attend(q, k, v, scale)
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
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}]={self.layer_type!r}; this drafter supports {LAYER_TYPES}")
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = self.layer_type == "sliding_attention" if is_causal is None else bool(is_causal)

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
        if mask is None and (self.is_causal or self.sliding_window is not None):
            mask = default_mask(q_len, k.shape[2], self.is_causal, self.sliding_window, q.device)
        out = attend(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        act = getattr(config, "hidden_act", "silu")
        if act not in ACT2FN:
            raise ValueError(f"hidden_act={act!r} is not a transformers activation")
        self.act_fn = ACT2FN[act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


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
    decoder_layer_cls = DFlashDecoderLayer  # a subclass (modeling_dflash2.py) swaps in its own layer
    unsupported = UNSUPPORTED  # ... and the fields it implements leave this dict

    def __init__(self, config):
        super().__init__(config)
        for name, absent in self.unsupported.items():
            if dflash_field(config, name, absent) not in (absent, None):
                raise ValueError(f"config sets {name}={dflash_field(config, name)!r}, which this DFlash drafter "
                                 f"file does not implement; load it with the code that trained it")
        rope = getattr(config, "rope_parameters", None) or {}
        if (float(rope.get("partial_rotary_factor", 1.0)) != 1.0 or "mrope_section" in rope
                or getattr(config, "is_neox_style", True) is False):
            raise ValueError(f"rope_parameters {rope}: this drafter file rotates the full head_dim in neox halves "
                             f"(1-D RoPE); partial, multimodal or interleaved RoPE is not implemented")
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers))
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
        """lm_head(hidden) times output_multiplier, soft-capped by final_logit_softcapping (when set)."""
        logits = lm_head(hidden) * float(dflash_field(self.config, "output_multiplier", 1.0))
        softcap = dflash_field(self.config, "final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0) -> torch.LongTensor:
        """Speculative decoding of one sequence with ``target`` (an HF causal LM); returns prompt + new ids.

        Each round: the drafter fills the block [last token, MASK x (B-1)] from the target features of the
        tokens committed since the last round; the target verifies the block in one forward; the longest
        prefix it agrees with is kept, plus the target's own next token. temperature 0 is greedy (argmax);
        otherwise draft tokens are sampled and accepted by the speculative rejection rule."""
        _check_sampling(temperature, top_p, top_k)
        self.eval()
        device, b = input_ids.device, self.block_size
        n_in = input_ids.shape[1]
        max_length = n_in + max_new_tokens
        out = torch.full((1, max_length + 1), int(self.mask_token_id), dtype=torch.long, device=device)
        positions = torch.arange(out.shape[1], device=device)[None]
        target_cache, draft_cache = DynamicCache(config=target.config), DynamicCache()
        cache_kw = _cache_kwarg(target)
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        stops = torch.tensor(stop_token_ids or [], dtype=torch.long, device=device)

        res = target(input_ids, position_ids=positions[:, :n_in], use_cache=True, logits_to_keep=1,
                     output_hidden_states=True, **{cache_kw: target_cache})
        out[:, :n_in] = input_ids
        out[:, n_in] = _sample(res.logits[:, -1], temperature, top_p, top_k)
        features = self.context_features(res.hidden_states)
        _crop_to(target_cache, n_in)
        start = n_in
        stopped = bool(torch.isin(out[:, start], stops).any())
        while start + 1 < max_length and not stopped:
            size = min(b, max_length - start)
            block = out[:, start:start + size].clone()
            if size > 1:
                noise = F.embedding(block, embed) * self.input_embedding_scale
                hidden = self(position_ids=positions[:, start - features.shape[1]:start + size],
                              noise_embedding=noise, target_hidden=features, past_key_values=draft_cache,
                              use_cache=True)[:, 1 - size:]
                _crop_to(draft_cache, start)
                block[:, 1:], draft_probs = self.draft_tokens(hidden, block[:, 0], head, temperature, top_p, top_k)
            res = target(block, position_ids=positions[:, start:start + size], use_cache=True,
                         output_hidden_states=size > 1, **{cache_kw: target_cache})
            if temperature > 0:
                target_probs = _probs(res.logits, temperature, top_p, top_k)
                accepted, bonus = (_rejection(block[:, 1:], target_probs, draft_probs) if size > 1
                                   else (0, torch.multinomial(target_probs[0, -1], 1)[0]))
            else:
                verified = torch.argmax(res.logits, -1)
                accepted = int((block[:, 1:] == verified[:, :-1]).cumprod(1).sum(1)[0])
                bonus = verified[0, accepted]
            out[:, start:start + accepted + 1] = block[:, :accepted + 1]
            out[:, start + accepted + 1] = bonus
            produced = min(accepted + 1, max_length - start - 1)
            hits = torch.isin(out[0, start + 1:start + produced + 1], stops).nonzero()
            if hits.numel():
                produced, stopped = int(hits[0, 0]) + 1, True
            start += produced
            _crop_to(target_cache, start)
            if size > 1:
                features = self.context_features(res.hidden_states)[:, :produced]
        return out[:, :min(start + 1, max_length)]

    def draft_tokens(self, hidden, anchor_ids, head, temperature: float, top_p: float, top_k: int):
        """The block's draft tokens [b, B-1] from its final hidden states, and their sampling distribution over
        the vocabulary (None when greedy): the argmax of the logits, or a sample of them."""
        draft_logits = self.compute_logits(hidden, head)
        if temperature <= 0:
            return torch.argmax(draft_logits, -1), None
        draft_probs = _probs(draft_logits, temperature, top_p, top_k)
        return torch.multinomial(draft_probs[0], 1).T, draft_probs

    def context_features(self, hidden_states) -> torch.Tensor:
        """The tapped layers' outputs (HF hidden_states[i + 1]) concatenated on the feature axis."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)


def _crop_to(cache, length: int) -> None:
    """Keep the first ``length`` positions (a negative crop: transformers 5.24 refuses positive ones)."""
    cache.crop(length - cache.get_seq_length())


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.24 names the cache argument ``cache``, earlier versions ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError("temperature and top_k must be non-negative, and top_p in (0, 1]")


def _probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Sampling distribution: temperature, then top-k, then top-p (nucleus), as the reference computes it."""
    scores = logits.float() / temperature
    indices = None
    if 0 < top_k < scores.shape[-1]:
        scores, indices = torch.topk(scores, top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs * (sorted_probs.cumsum(-1) - sorted_probs < top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
    return probs


filtered_probs = _probs  # the public name modeling_dspark.py samples its Markov-biased logits with


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    return torch.multinomial(_probs(logits, temperature, top_p, top_k), 1)[:, 0]


def _rejection(draft: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor):
    """Speculative sampling: accept draft token k with probability min(1, p/q) while all before it were
    accepted; on the first rejection sample from the residual max(p - q, 0), else the bonus from p."""
    gamma = draft.shape[1]
    p = target_probs[:, :gamma].gather(-1, draft[..., None])[..., 0]
    q = draft_probs.gather(-1, draft[..., None])[..., 0]
    accepted = int((torch.rand_like(q) * q < p).to(torch.int32).cumprod(-1).sum(-1)[0])
    if accepted == gamma:
        return accepted, torch.multinomial(target_probs[0, -1], 1)[0]
    residual = (target_probs[0, accepted] - draft_probs[0, accepted]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[0, accepted]
    return accepted, torch.multinomial(residual, 1)[0]
