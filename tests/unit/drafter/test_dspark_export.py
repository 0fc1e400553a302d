"""DSpark exports (the common export path, drafter/export.py, asking drafter/kinds/dspark.py) against a
transcription of what vLLM 0.26.0 reads (the wheel's sources, paths under vllm/), and loaded back by transformers
and dflashkit from the files they ship."""

import json

import pytest
import torch
from transformers import AutoModel, LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.errors import UserError

from support.exports import forward_without_dflashkit

TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=60)

# ------------------------------------------------------------------ vLLM 0.26.0, transcribed
# model_executor/models/qwen3_dflash.py:332-343 (hf_to_vllm_mapper): q/k/v and gate/up load into stacked params
STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def vllm_parameters(cfg: dict) -> dict[str, tuple]:
    """The parameters Qwen3DSparkForCausalLM holds at tensor parallel 1, name -> shape (stacked shards as a dict
    shard -> shape): qwen3_dspark.py:36-127 (Markov head, lm_head, d2t), qwen3_dflash.py:356-423 (embedding, mask
    embedding, fc sized by dflash_config.target_layer_ids, norms), :135-225 and :252-310 (a layer: qkv_proj,
    o_proj, q/k_norm, Qwen3MLP's gate_up_proj/down_proj, the two layernorms)."""
    h, vocab, rank = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]  # markov_rank: an attribute read
    draft_vocab = cfg.get("draft_vocab_size") or vocab
    heads, kv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // heads
    drafter = {**(cfg.get("eagle_config") or {}), **(cfg.get("dflash_config") or {})}
    taps = (len(drafter["target_layer_ids"]) if "target_layer_ids" in drafter
            else len(drafter["layer_ids"]) if "layer_ids" in drafter else cfg["num_hidden_layers"])
    assert not cfg.get("attention_bias") and not cfg.get("add_swa_attention_sink_bias")  # not transcribed
    params = {"model.embed_tokens.weight": (vocab, h), "model.mask_embedding": (h,),
              "model.fc.weight": (h, cfg.get("target_hidden_size", h) * taps), "model.hidden_norm.weight": (h,),
              "model.norm.weight": (h,), "model.markov_head.markov_w1.weight": (vocab, rank),
              "model.markov_head.markov_w2.weight": (draft_vocab, rank), "lm_head.weight": (draft_vocab, h)}
    if draft_vocab != vocab:
        params["draft_id_to_target_id"] = (draft_vocab,)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        params.update({
            p + "self_attn.qkv_proj.weight": {"q": (heads * d, h), "k": (kv * d, h), "v": (kv * d, h)},
            p + "self_attn.o_proj.weight": (h, heads * d), p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,), p + "mlp.gate_up_proj.weight": {0: (inter, h), 1: (inter, h)},
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    return params


def vllm_load(tensors: dict[str, tuple], cfg: dict) -> None:
    """Qwen3DSparkForCausalLM.load_weights (qwen3_dspark.py:149-185) on file tensors (name -> shape): t2d dropped,
    d2t renamed, every other name but lm_head prefixed "model."; mask_embedding and confidence_head skipped, and
    embed_tokens / lm_head / draft_id_to_target_id when the file has none (then shared from the target,
    dspark/utils.py:56-72). A name without a parameter fails as AutoWeightsLoader does; a wrong shape fails the
    weight loader. load_weights returns None, so vLLM's loader never checks that every parameter got a tensor:
    a missing one stays uninitialised silently, so this transcription fails on it."""
    params = vllm_parameters(cfg)
    renamed = {}
    for name, shape in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        renamed[name] = shape
    skip = ["mask_embedding", "confidence_head"] + [s for s in ("embed_tokens", "lm_head", "draft_id_to_target_id")
                                                     if not any(s in n for n in renamed)]
    loaded: dict[str, set] = {}
    for name, shape in renamed.items():
        if any(s in name for s in skip):
            continue
        name, shard = name.replace("midlayer.", "layers.0."), None
        for old, (new, shard_id) in STACKED.items():
            if old in name:
                name, shard = name.replace(old, new), shard_id
                break
        if name not in params:
            raise AssertionError(f"vLLM has no parameter for {name}")
        want = params[name][shard] if shard is not None else params[name]
        if tuple(shape) != tuple(want):
            raise AssertionError(f"{name} {shard}: file shape {tuple(shape)}, vLLM's {want}")
        loaded.setdefault(name, set()).add(shard)
    for name, shape in params.items():
        if any(s in name for s in skip):
            continue
        shards = set(shape) if isinstance(shape, dict) else {None}
        if loaded.get(name) != shards:
            raise AssertionError(f"{name}: no tensor in the file (vLLM would leave it uninitialised)")


def vllm_serving_settings(cfg: dict, num_speculative_tokens: int) -> dict:
    """What vLLM 0.26 derives from config.json to serve a DSpark drafter."""
    dflash = cfg.get("dflash_config") or {}
    if cfg.get("dspark_block_size") is not None and num_speculative_tokens < cfg["dspark_block_size"]:
        raise ValueError("DSpark requires num_speculative_tokens >= dspark_block_size")  # speculative.py:1004-1027
    if "mask_token_id" in dflash:  # v1/worker/gpu/spec_decode/utils.py:55-78
        mask = dflash["mask_token_id"]
    else:
        mask = next(cfg[k] for k in ("mask_token_id", "dspark_noise_token_id") if cfg.get(k) is not None)
    taps = (cfg.get("eagle_aux_hidden_state_layer_ids")  # v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:35-58
            or [i + 1 for i in dflash.get("target_layer_ids") or []]
            or [i + 1 for i in cfg.get("dspark_target_layer_ids") or cfg.get("target_layer_ids") or []])
    layer_types = cfg.get("layer_types")  # qwen3_dflash.py:55-61
    causal = [dflash["causal"] if dflash.get("causal") is not None
              else bool(layer_types) and layer_types[i] == "sliding_attention"
              for i in range(cfg["num_hidden_layers"])]
    bonus = bool(cfg.get("dspark_bonus_anchor", False))  # dspark/speculator.py:43-51
    return {"method": "dspark" if "Qwen3DSparkModel" in cfg["architectures"] else None,  # speculative.py:882-887
            "queries_per_request": num_speculative_tokens + (1 if bonus else 0), "mask_token_id": mask,
            "aux_layers": taps, "causal": causal}


# ------------------------------------------------------------------ the tests
def dspark_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors an export holds: the model's own, without the RoPE tables."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}


def drafter(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(TARGET, num_hidden_layers=2, block_size=5, mask_token_id=59, architecture="dspark",
                                   markov_rank=6, **{"target_layer_ids": [1, 4, 6], **kw})
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # every tensor distinct from its start (markov_w2 starts at 0)
    return cfg, model


@pytest.mark.parametrize("kw", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
                                {"causal": True}])
def test_vllm_026_loads_every_tensor_and_serves_the_trained_block(tmp_path, kw):
    cfg, model = drafter(**kw)
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {"confidence_head.proj.weight", "markov_head.markov_w1.weight"} <= set(shapes)
    vllm_load(shapes, config)
    served = vllm_serving_settings(config, num_speculative_tokens=cfg.block_size - 1)
    assert served["method"] == "dspark" and served["mask_token_id"] == 59
    assert served["queries_per_request"] == cfg.block_size  # the anchor + block_size - 1 masks dflashkit trains
    assert served["aux_layers"] == [2, 5, 7]  # hidden_states[i + 1] of target_layer_ids [1, 4, 6]
    assert served["causal"] == [layer.self_attn.is_causal for layer in model.layers]
    if cfg.causal:  # the first j drafts do not depend on k >= j: any k is served
        assert vllm_serving_settings(config, num_speculative_tokens=2)["queries_per_request"] == 3
    else:  # a non-causal layer sees the whole block: fewer masks than trained is refused
        with pytest.raises(ValueError, match="dspark_block_size"):
            vllm_serving_settings(config, num_speculative_tokens=cfg.block_size - 2)


@pytest.mark.parametrize("change", ["drop markov_w2", "prefix model.", "fc for 2 taps"])
def test_the_transcription_refuses_what_vllm_would_not_load(tmp_path, change):
    cfg, model = drafter()
    config = json.loads(json.dumps(cfg.to_json_dict()))
    shapes = {k: tuple(v.shape) for k, v in dspark_state_dict(model).items()}
    if change == "drop markov_w2":
        del shapes["markov_head.markov_w2.weight"]
    elif change == "prefix model.":
        shapes = {"model." + k: v for k, v in shapes.items()}
    else:
        config["dflash_config"]["target_layer_ids"] = [1, 4]
    with pytest.raises(AssertionError):
        vllm_load(shapes, config)


def test_transformers_loads_the_export_without_dflashkit(tmp_path):
    cfg, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DSparkDraftModel" and loaded.markov_head.markov_w1.weight.shape == (60, 6)
    want = dspark_state_dict(model)
    got = dspark_state_dict(loaded)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    inputs = {"position_ids": torch.arange(9)[None], "noise_embedding": torch.randn(1, 5, 32),
              "target_hidden": torch.randn(1, 4, 96)}
    with torch.no_grad():
        torch.testing.assert_close(forward_without_dflashkit(out, inputs, tmp_path, "DSparkDraftModel"),
                                   model(**inputs))


def test_the_export_loads_back_as_the_same_dspark_drafter(tmp_path):
    cfg, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 6
    assert config["auto_map"] == {"AutoModel": "modeling_dspark.DSparkDraftModel"}
    loaded = load_drafter(out)
    assert loaded.dflash == cfg and type(loaded).__name__ == "DSparkDraftModel"
    want, got = dspark_state_dict(model), dspark_state_dict(loaded)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_config_naming_dspark_without_markov_rank_is_refused(tmp_path):
    _, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    del config["markov_rank"], config["dflash_config"]["markov_rank"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="markov_rank"):
        load_drafter(out)
