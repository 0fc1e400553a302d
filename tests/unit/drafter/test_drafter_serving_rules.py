"""An export serves exactly as it was trained: for every target family, a re-implementation of how vLLM and
SGLang read the exported config.json (RoPE, block embedding, layer types, mask token, layer ids) reproduces the
training forward bit for bit in fp32.

The engine readers below follow the engines' code (cited per line; drafter/serving_rules.py has the table): they
read only config.json and the target, never DrafterConfig. Everything is packed the way training packs blocks
(several anchors, one pass), so the only thing that can differ is what each side derives from its inputs.
"""

import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.drafter.serving_rules import UNSERVABLE
from dflashkit.errors import UserError
from dflashkit.targets.capture import LayerCapture
from dflashkit.targets.loading import FAMILIES, load_target
from dflashkit.train.block_mask import build_block_masks

from support.tiny_targets import noisy_norms, tiny_tokenizer

_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# what a Qwen3.5/3.6 checkpoint's config.json carries: M-RoPE sections and a partial rotary factor
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                "mrope_interleaved": True}
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
_MM_IDS = dict(image_token_id=296, video_token_id=297, vision_start_token_id=298, vision_end_token_id=299)


def _text(model_type: str) -> dict:
    """Keyword arguments of the tiny text config of a family."""
    if model_type.startswith("qwen3_5") or model_type == "qwen3_next":
        extra = dict(**_LINEAR, rope_parameters=dict(_QWEN35_ROPE))
        if "moe" in model_type or model_type == "qwen3_next":
            extra.update(_MOE, shared_expert_intermediate_size=32)
        return {**_BASE, **extra}
    if model_type == "qwen3_moe":
        return {**_BASE, **_MOE}
    if model_type == "gpt_oss":  # its own YaRN RoPE, sinks, sliding + full layers
        return {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}
    if model_type.startswith("gemma3"):
        return {**_BASE, "sliding_window": 4}
    return dict(_BASE)


def target_config(model_type: str):
    """A tiny config of every FAMILIES key (multimodal ones as their wrapper config)."""
    kw = _text(model_type)
    if model_type == "qwen2":
        kw.pop("head_dim")
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        cls = tf.Qwen3_5Config if model_type == "qwen3_5" else tf.Qwen3_5MoeConfig
        return cls(text_config=kw, vision_config=_VISION, **_MM_IDS)
    if model_type == "gemma3":
        return tf.Gemma3Config(text_config=dict(model_type="gemma3_text", **kw))
    return tf.AutoConfig.for_model(model_type, **kw)


SERVABLE = [t for t in FAMILIES if t not in UNSERVABLE]
LAYOUT = dict(num_hidden_layers=3, block_size=4, layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"], sliding_window=5)


# ----------------------------------------------------------------------------- the engines' readings
def vllm_view(cfg: dict) -> dict:
    """What vLLM's DFlash loader takes from config.json."""
    dflash = cfg.get("dflash_config") or {}
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert rope.get("rope_type", "default") == "default" and "mrope_section" not in rope, "this reader: 1-D only"
    types = cfg.get("layer_types")
    layers = []
    for i in range(cfg["num_hidden_layers"]):  # qwen3_dflash._resolve_layer_attention / _dflash_layer_causal
        sliding = bool(types) and types[i] == "sliding_attention"
        causal = dflash.get("causal")  # 0.24: only dflash_config.causal (v1/spec_decode/dflash.py:71,305-307)
        window = dflash.get("swa_window_size", cfg.get("sliding_window"))
        # Attention(per_layer_sliding_window=W): the flash-attn window (W - 1, 0)
        layers.append(dict(causal=sliding if causal is None else bool(causal),
                           window_left=window - 1 if sliding else None))
    return dict(
        # eagle3_utils.get_eagle3_aux_layers_from_config: aux id i + 1 = the input of layer i + 1
        hidden_state_index=cfg.get("eagle_aux_hidden_state_layer_ids")
        or [i + 1 for i in dflash["target_layer_ids"]],
        mask_token_id=dflash.get("mask_token_id", cfg.get("mask_token_id")),  # DFlashQwen3Model.__init__
        # rotary_embedding.get_rope: rotary_dim = head_size * partial_rotary_factor; theta default 1e6
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)), head_dim=head_dim,
        theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
        embed="raw rows",  # llm_base_proposer: the drafter's embed_tokens is the target's model.embed_tokens
        layers=layers, act=cfg.get("hidden_act", "silu"))


def sglang_view(cfg: dict) -> dict:
    """What SGLang's DFlash loader takes from config.json."""
    dflash = cfg.get("dflash_config") or {}
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    scaling = cfg.get("rope_scaling")
    assert not scaling or scaling.get("rope_type", "default") == "default", "this reader: unscaled RoPE only"
    types = cfg.get("layer_types")
    layers = []
    for i in range(cfg["num_hidden_layers"]):  # models/dflash._get_dflash_layer_attention_params
        sliding = bool(types) and types[i] == "sliding_attention"
        # window_left = sliding_window - 1 (dflash_utils.get_dflash_attention_sliding_window_size); is_causal from
        # the text config, read only when layer_types is present: full layers causal when true, sliding ones
        # non-causal when false (models/dflash.py:157-191)
        causal = cfg.get("is_causal") if types else None
        layers.append(dict(causal=sliding if causal is None else bool(causal),
                           window_left=int(cfg["sliding_window"]) - 1 if sliding else None))
    return dict(
        # parse_dflash_draft_config: 0-based layer ids, captured before layer i + 1
        hidden_state_index=[i + 1 for i in dflash.get("target_layer_ids", cfg.get("target_layer_ids"))],
        mask_token_id=dflash.get("mask_token_id", cfg.get("mask_token_id")),
        rotary_dim=head_dim, head_dim=head_dim,  # models/dflash.DFlashAttention: get_rope(rotary_dim=head_dim)
        theta=float(cfg.get("rope_theta", 10000.0)),
        embed="target module",  # dflash_worker: target_model.get_input_embeddings()(block_ids)
        layers=layers, act=cfg.get("hidden_act", "silu"))


def rope_cos_sin(view: dict, positions: torch.Tensor):
    """The engines' RotaryEmbedding cache: inv_freq over rotary_dim, neox halves (vLLM rotary_embedding/base)."""
    rot = view["rotary_dim"]
    inv_freq = 1.0 / (view["theta"] ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin, rot):
    """Neox style on the first ``rot`` dims, the rest passed through (vLLM/SGLang forward_native)."""
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], dim=-1)


def rms(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def packed_mask(view_layer: dict, anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """The engine's visibility for each packed block: context keys before its anchor, its own block's keys;
    causal layers see keys at positions <= the query's, windowed ones ``window_left`` positions back at most."""
    n, b = anchors.numel(), block_size
    q_pos = (anchors[:, None] + torch.arange(b)[None]).reshape(-1)
    q_blk = torch.arange(n).repeat_interleave(b)
    k_pos = torch.cat([torch.arange(ctx_len), q_pos])
    k_blk = torch.cat([torch.full((ctx_len,), -1), q_blk])
    visible = torch.where(k_blk[None] < 0, k_pos[None] < anchors[q_blk][:, None], k_blk[None] == q_blk[:, None])
    if view_layer["causal"]:
        visible &= k_pos[None] <= q_pos[:, None]
    if view_layer["window_left"] is not None:
        visible &= q_pos[:, None] - k_pos[None] <= view_layer["window_left"]
    return visible[None, None]


def engine_forward(export_dir, view, hidden_states, embed_module, token_ids, anchors):
    """The drafter as the engine computes it, from the export directory and the target's own states."""
    from safetensors.torch import load_file

    cfg = json.loads((export_dir / "config.json").read_text())
    w = load_file(str(export_dir / "model.safetensors"))
    eps, hd, rot, b = cfg["rms_norm_eps"], view["head_dim"], view["rotary_dim"], cfg["block_size"]
    assert view["act"] == "silu"
    ctx_len = token_ids.shape[1]
    feats = torch.cat([hidden_states[i] for i in view["hidden_state_index"]], dim=-1)
    ids = torch.full((anchors.numel(), b), view["mask_token_id"])
    ids[:, 0] = token_ids[0, anchors]
    rows = ids.reshape(1, -1)
    h = F.embedding(rows, embed_module.weight) if view["embed"] == "raw rows" else embed_module(rows)
    positions = torch.cat([torch.arange(ctx_len), (anchors[:, None] + torch.arange(b)).reshape(-1)])
    cos, sin = rope_cos_sin(view, positions)
    ctx = rms(F.linear(feats, w["fc.weight"]), w["hidden_norm.weight"], eps)
    q_len = h.shape[1]
    for i, layer in enumerate(view["layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        q = rms(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(1, q_len, -1, hd), w[p + "self_attn.q_norm.weight"],
                eps).transpose(1, 2)
        k = torch.cat([F.linear(ctx, w[p + "self_attn.k_proj.weight"]), F.linear(x, w[p + "self_attn.k_proj.weight"])],
                      dim=1).view(1, ctx_len + q_len, -1, hd)
        v = torch.cat([F.linear(ctx, w[p + "self_attn.v_proj.weight"]), F.linear(x, w[p + "self_attn.v_proj.weight"])],
                      dim=1).view(1, ctx_len + q_len, -1, hd).transpose(1, 2)
        k = rms(k, w[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        q = apply_rope(q, cos[-q_len:], sin[-q_len:], rot)
        k = apply_rope(k, cos, sin, rot)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = packed_mask(layer, anchors, ctx_len, b)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5)
        h = h + F.linear(out.transpose(1, 2).reshape(1, q_len, -1), w[p + "self_attn.o_proj.weight"])
        x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
    return rms(h, w["norm.weight"], eps)


# ----------------------------------------------------------------------------- training's side
def _tiny_target(model_type: str, out_dir):
    torch.manual_seed(0)
    config = target_config(model_type)
    text = config.get_text_config()
    model = noisy_norms(tf.AutoModelForCausalLM.from_config(text, dtype=torch.float32))  # a multimodal's text model
    model.save_pretrained(out_dir)
    tiny_tokenizer().save_pretrained(out_dir)
    return config, load_target(out_dir)


def training_forward(model, dcfg: DrafterConfig, target, token_ids, anchors):
    """What training computes: captured features, the target's embedding of the block, the packed block mask."""
    with LayerCapture(target, dcfg.target_layer_ids) as capture:
        features, _ = capture(token_ids, torch.ones_like(token_ids))
    b = dcfg.block_size
    ids = torch.full((anchors.numel(), b), dcfg.mask_token_id)
    ids[:, 0] = token_ids[0, anchors]
    positions = torch.cat([torch.arange(token_ids.shape[1]), (anchors[:, None] + torch.arange(b)).reshape(-1)])
    mask = build_block_masks(anchors, token_ids.shape[1], b, dcfg.layer_types, dcfg.sliding_window,
                             causal=dcfg.causal)
    return model(position_ids=positions[None], attention_mask=mask, noise_embedding=target.embed(ids.reshape(1, -1)),
                 target_hidden=features)


@pytest.mark.parametrize("model_type", SERVABLE)
def test_engines_reproduce_the_training_forward(model_type, tmp_path):
    config, target = _tiny_target(model_type, tmp_path / "target")
    dcfg = DrafterConfig.for_target(config, mask_token_id=299, **LAYOUT)
    model = build_drafter(dcfg).eval()
    save_drafter(model, tmp_path / "d")
    exported = json.loads((tmp_path / "d" / "config.json").read_text())
    token_ids = torch.randint(4, 244, (1, 14))
    anchors = torch.tensor([2, 5, 9, 13])  # the last block runs past the sequence, as training allows
    with torch.no_grad():
        trained = training_forward(model, dcfg, target, token_ids, anchors)
        states = target.model(token_ids, output_hidden_states=True).hidden_states
        embed = target.model.get_input_embeddings()
        for view in (vllm_view(exported), sglang_view(exported)):
            served = engine_forward(tmp_path / "d", view, states, embed, token_ids, anchors)
            assert torch.equal(served, trained), (model_type, view["embed"])


@pytest.mark.parametrize("causal", [True, False])
def test_engines_reproduce_the_training_forward_of_a_causal_in_block_drafter(tmp_path, causal):
    """The causal-in-block layout (every layer the whole context, causal inside the block) as vLLM 0.24 reads it
    (dflash_config.causal) and as SGLang reads it (is_causal with layer_types); the non-causal default beside it."""
    config, target = _tiny_target("qwen3", tmp_path / "target")
    dcfg = DrafterConfig.for_target(config, mask_token_id=299, num_hidden_layers=2, block_size=4, causal=causal)
    model = build_drafter(dcfg).eval()
    save_drafter(model, tmp_path / "d")
    exported = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (exported.get("is_causal"), exported["dflash_config"].get("causal")) == ((True, True) if causal
                                                                                    else (None, None))
    token_ids, anchors = torch.randint(4, 244, (1, 14)), torch.tensor([2, 5, 9, 13])
    with torch.no_grad():
        trained = training_forward(model, dcfg, target, token_ids, anchors)
        states = target.model(token_ids, output_hidden_states=True).hidden_states
        embed = target.model.get_input_embeddings()
        for view in (vllm_view(exported), sglang_view(exported)):
            assert [layer["causal"] for layer in view["layers"]] == [causal, causal]
            assert torch.equal(engine_forward(tmp_path / "d", view, states, embed, token_ids, anchors), trained)


@pytest.mark.parametrize("fields, problem", [
    ({"is_causal": True}, "is_causal=True and dflash_config.causal=None"),
    ({"dflash_config": {"causal": True}}, "is_causal=None and dflash_config.causal=True"),
    ({"is_causal": True, "dflash_config": {"causal": False}}, "is_causal=True and dflash_config.causal=False"),
    ({"is_causal": False, "dflash_config": {"causal": False}}, "is_causal=False and dflash_config.causal=False"),
    ({"is_causal": "yes"}, "is_causal is 'yes'; it must be true or false"),
])
def test_a_causal_flag_only_one_engine_reads_is_refused(tmp_path, fields, problem):
    save_drafter(build_drafter(DrafterConfig.for_target(target_config("qwen3"), mask_token_id=299)), tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    data.update({k: v for k, v in fields.items() if k != "dflash_config"})
    data["dflash_config"].update(fields.get("dflash_config", {}))
    with pytest.raises(UserError, match=re.escape(problem)):
        DrafterConfig.from_json_dict(data)
    data["is_causal"] = data["dflash_config"]["causal"] = True  # both true: the causal-in-block layout
    assert DrafterConfig.from_json_dict(data).causal is True


def test_the_check_fails_when_the_export_copies_a_qwen35_rope(tmp_path):
    """The same comparison, on an export that copies the target's M-RoPE / partial rotary factor as vLLM would
    read it: the served forward differs, so the test above can fail."""
    config, target = _tiny_target("qwen3_5_text", tmp_path / "target")
    dcfg = DrafterConfig.for_target(config, mask_token_id=299, **LAYOUT)
    model = build_drafter(dcfg).eval()
    save_drafter(model, tmp_path / "d")
    exported = json.loads((tmp_path / "d" / "config.json").read_text())
    exported["rope_parameters"] = {k: v for k, v in _QWEN35_ROPE.items() if not k.startswith("mrope")}
    token_ids, anchors = torch.randint(4, 244, (1, 12)), torch.tensor([3, 7])
    with torch.no_grad():
        trained = training_forward(model, dcfg, target, token_ids, anchors)
        states = target.model(token_ids, output_hidden_states=True).hidden_states
        served = engine_forward(tmp_path / "d", vllm_view(exported), states, target.model.get_input_embeddings(),
                                token_ids, anchors)
    assert vllm_view(exported)["rotary_dim"] == 4 and not torch.equal(served, trained)


@pytest.mark.parametrize("model_type", sorted(UNSERVABLE))
def test_unservable_family_is_refused_with_the_reason(model_type):
    with pytest.raises(ValueError, match="vLLM feeds the drafter the raw embedding rows, SGLang"):
        DrafterConfig.for_target(target_config(model_type), mask_token_id=299)


def test_export_writes_only_fields_both_engines_read_alike(tmp_path):
    config = target_config("qwen3_5")
    save_drafter(build_drafter(DrafterConfig.for_target(config, mask_token_id=299, **LAYOUT)), tmp_path / "d")
    exported = json.loads((tmp_path / "d" / "config.json").read_text())
    assert exported["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert exported["rope_theta"] == 1e7 and exported["rope_scaling"] is None
    for field in ("is_causal", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                  "partial_rotary_factor", "eagle_aux_hidden_state_layer_ids"):
        assert field not in exported and field not in exported["dflash_config"]
    assert exported["dtype"] == exported["torch_dtype"] == "float32"  # save_drafter keeps the model's dtype


@pytest.mark.parametrize("field, value", [("is_causal", True), ("output_multiplier", 2.0),
                                          ("final_logit_softcapping", 30.0), ("attention_sink_bias", True),
                                          ("rope_parameters", dict(_QWEN35_ROPE)), ("hidden_act", "gelu"),
                                          ("input_embedding_scale", 8.0)])
def test_config_with_a_field_the_engines_read_differently_is_refused(tmp_path, field, value):
    save_drafter(build_drafter(DrafterConfig.for_target(target_config("qwen3"), mask_token_id=299)), tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    data[field] = value
    with pytest.raises(ValueError, match=field):
        DrafterConfig.from_json_dict(data)


def test_init_drafter_refuses_a_gemma3_target_in_one_line(tmp_path, capsys):
    from dflashkit.cli import main as cli

    _tiny_target("gemma3_text", tmp_path / "gemma")
    assert cli(["init-drafter", "--target", str(tmp_path / "gemma"), "--out", str(tmp_path / "d"),
                "--mask-token-id", "299"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Gemma 3 targets cannot be served faithfully" in errors[0]
    assert not (tmp_path / "d").exists()

