"""What vLLM 0.26.0 reads of a DSpark drafter directory, transcribed from the wheel's sources (paths under vllm/):
the parameters its DSpark model holds, its weight loader, and the serving settings it derives from config.json
(tests/unit/drafter/test_dspark_export.py checks the transcription refuses what vLLM would not load)."""

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
