"""What vLLM and SGLang compute from a DFlash export: the one place that says it.

A drafter is served faithfully only if the engine computes, from ``config.json``, the forward that training ran.
``ENGINE_FIELDS`` lists every config field the engines' DFlash loaders read and what each does (each row cites
the engine file it comes from). The rest of this module turns that table into rules:

- RoPE. vLLM builds the drafter's rotary embedding with its generic factory from ``rope_parameters`` (it honours
  ``partial_rotary_factor``, ``mrope_section``, ``mrope_interleaved`` and every scaling type); SGLang always
  rotates the full ``head_dim`` from ``rope_theta`` / ``rope_scaling``. The only RoPE both apply alike is plain
  1-D RoPE over the full head_dim, so every drafter uses exactly that, with the target's (full-attention)
  ``rope_theta``: a Qwen3.5/3.6 target's M-RoPE sections and partial rotary factor are not copied (for text,
  M-RoPE with equal position ids is 1-D RoPE anyway, and the drafter's rotation is its own).
- Block embedding. vLLM gives the drafter the target's ``embed_tokens`` module (raw rows); SGLang calls the
  target's ``get_input_embeddings()`` (for Gemma 3 a module that multiplies by sqrt(hidden_size)); neither reads
  ``input_embedding_scale``. A target whose embedding scales (Gemma 3) therefore gets two different blocks from
  the two engines: it is refused (``unservable_reason``).
- Attention layout. ``full_attention`` layers are non-causal over context + block; ``sliding_attention`` layers
  are causal with a window of ``sliding_window`` keys including the query's own. The causal-in-block layout
  (``DrafterConfig.causal``: every layer sees the whole context and is causal inside the block) is read from two
  fields, one per engine: vLLM 0.24 reads only ``dflash_config.causal``, SGLang and the reference only the
  top-level ``is_causal``. An export of that layout writes both true; a config that sets only one, or sets them
  differently, or sets either false, is refused (``causal_in_block``): engines would run it differently.
- vLLM's rules by release (the last-layer tap, sliding-window layers, the model runner of a per-batch-size
  schedule, num_speculative_tokens, a GGUF target's config) are drafter/vllm_rules.py's (``VLLM_RULES``).
- vLLM 0.28 DFlash2 rules (in drafter/vllm_dflash2.py: ``VLLM_028_DFLASH2_RULES``, each citing the 0.28 file;
  0.28 needs torch 2.13, so they are checked against its source in a CPU test, not run): the four DFlash2 fields
  under ``dflash_config``, the weights it loads by name and shape (``vllm028_dflash2_problems``),
  num_speculative_tokens = block_size - 1 and no per-batch-size schedule (``check_vllm_num_speculative_tokens``,
  ``check_vllm_schedule``). 0.28 also applies
  ``dflash_config.input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping`` to a DFlash2
  drafter: left at their defaults, as trained.
- Nothing else. Fields that only one engine reads (``output_multiplier``, ``final_logit_softcapping``,
  ``attention_sink_bias``, ``use_swa``, ``swa_window_size``, ``logit_scale``) are never written and are refused
  when a config to be trained or evaluated sets them.
"""

from __future__ import annotations

from dflashkit.errors import UserError

# field -> (what vLLM does with it, what SGLang does with it). vLLM: vllm/model_executor/models/qwen3_dflash.py
# (the drafter), vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (taps), vllm/v1/spec_decode/
# llm_base_proposer.py (embedding sharing), vllm/model_executor/layers/rotary_embedding/__init__.py (get_rope).
# SGLang: python/sglang/srt/models/dflash.py (the drafter), python/sglang/srt/speculative/dflash_utils.py
# (config parsing), python/sglang/srt/speculative/dflash_worker.py (block embedding, mask token, block size).
ENGINE_FIELDS: dict[str, tuple[str, str]] = {
    # eagle3_utils.get_eagle3_aux_layers_from_config: [i + 1 for i in target_layer_ids] (aux layer j = the input
    # of decoder layer j = the output of layer j - 1), used only when eagle_aux_hidden_state_layer_ids is absent;
    # dflash_utils.parse_dflash_draft_config / resolve_target_layer_ids: range-checked, captured before layer i+1
    "dflash_config.target_layer_ids": ("taps: output of decoder layer i (aux id i + 1)",
                                       "taps: output of decoder layer i (captured before layer i + 1)"),
    # qwen3_dflash.DFlashQwen3Model.__init__: dflash_config.mask_token_id, else top-level mask_token_id;
    # dflash_worker._resolve_mask_token_id: must be < the target's vocab_size and agree with the tokenizer's id of
    # dflash_config.mask_token (default "<|MASK|>") when the tokenizer has that token
    "dflash_config.mask_token_id": ("id of the MASK rows of the block", "id of the MASK rows of the block"),
    # dflash_worker.DFlashWorker.__init__: --speculative-num-draft-tokens wins, a differing config value warns
    "dflash_config.block_size": ("not read (num_speculative_tokens sets the block)",
                                 "default of --speculative-num-draft-tokens (16 when absent)"),
    # qwen3_dflash.DFlashQwen3Attention: get_rope(head_dim, max_position, is_neox_style, rope_parameters);
    # rotary_embedding.get_rope: rotary_dim = head_dim * partial_rotary_factor, mrope_section -> MRotaryEmbedding,
    # rope_type picks the scaling; set_default_rope_theta(config, 1e6) when rope_theta is missing.
    # models/dflash.DFlashAttention: get_rope(head_dim, rotary_dim=head_dim, base=rope_theta, rope_scaling)
    "rope_parameters": ("the drafter's RoPE: every key honoured", "rope_theta and rope_scaling; rotary dim = head_dim"),
    # qwen3_dflash.DFlashQwen3DecoderLayer: is_neox_style (default True); models/dflash: rope_is_neox_style
    "is_neox_style": ("rotate halves (True) or pairs", "rotate halves (True) or pairs"),
    # vLLM 0.24: qwen3_dflash.py:112-121,165-263 never read layer_types / sliding_window (every layer full
    # attention; VLLM_024_RULES["sliding_window"]); 0.26 reads both per layer (VLLM_026_RULES["sliding_window"]).
    # SGLang models/dflash._get_dflash_layer_attention_params (:166-191):
    # full -> ENCODER_ONLY (non-causal) unless is_causal, sliding -> DECODER (causal) with window_left =
    # sliding_window - 1; without layer_types every layer is non-causal and is_causal is ignored (:170-171)
    "layer_types": ("0.24: not read, every layer full attention; 0.26: per layer, as SGLang",
                    "per layer: full (non-causal) or sliding (causal, windowed)"),
    "sliding_window": ("0.24: not read; 0.26: keys a sliding query sees", "keys a sliding query sees, itself included"),
    # vLLM 0.24 never reads is_causal; SGLang models/dflash.py:157-163 reads it from the text config (with
    # layer_types present); the reference dflash 0.1.0 model.py:363-367 too
    "is_causal": ("not read (0.24)", "true: full_attention layers causal inside the block, no window"),
    # V1 runner: v1/spec_decode/dflash.py:71,178-195,305-307; V2: v1/worker/gpu/spec_decode/dflash/utils.py:11-31,
    # speculator.py:49,93,346-351; the queries are the last 1 + k keys, bottom-right causal over context + block
    "dflash_config.causal": ("true: every layer causal inside the block, whole context (V1 and V2 runners)",
                             "not read"),
    # qwen3_dflash: Qwen2MLP(hidden_act) (silu only); models/dflash.DFlashMLP: anything but silu is an error
    "hidden_act": ("SwiGLU activation (silu only)", "SwiGLU activation (silu only)"),
    # both: bias on q/k/v and on o_proj
    "attention_bias": ("bias on q/k/v/o projections", "bias on q/k/v/o projections"),
    "head_dim": ("per-head width (else hidden_size // heads)", "per-head width (else hidden_size // heads)"),
    "rms_norm_eps": ("every RMSNorm", "every RMSNorm"),
    "max_position_embeddings": ("RoPE cache length", "RoPE cache length (default 32768)"),
    # models/dflash.DFlashDraftModel: num_target_layers only feeds the default taps when target_layer_ids is absent
    "num_target_layers": ("not read", "default taps when target_layer_ids is absent"),
    # llm_base_proposer._maybe_share_embeddings: the drafter's embed_tokens := the target's model.embed_tokens
    # (raw rows); dflash_worker._prepare_for_speculative_decoding: target_model.get_input_embeddings()(block_ids)
    "input_embedding_scale": ("not read: raw embedding rows", "not read: the target's embedding module's output"),
    # dflash_utils.parse_dflash_draft_config reads both; the greedy drafter argmax ignores them
    "dflash_config.output_multiplier": ("not read", "parsed; greedy drafting ignores it"),
    "dflash_config.final_logit_softcapping": ("not read", "parsed; greedy drafting ignores it"),
    # qwen3_dflash.DFlashQwen3DecoderLayer / dflash_utils: per-head sink logits in every layer
    "dflash_config.attention_sink_bias": ("adds per-head sinks", "adds per-head sinks"),
    # qwen3_dflash.DFlashQwen3ForCausalLM: LogitsProcessor(scale=logit_scale)
    "logit_scale": ("scales the drafter's logits", "not read"),
    # vLLM/SGLang --dtype auto follow the config: float32 configs are served in float16
    "dtype": ("serving dtype under --dtype auto", "serving dtype under --dtype auto"),
    # DFlash2 (DrafterConfig.architecture = "dflash2"). vLLM: vllm/model_executor/models/registry.py maps
    # "DFlash2DraftModel" to qwen3_dflash2.DFlash2Qwen3ForCausalLM (speculative method still "dflash");
    # qwen3_dflash2.DFlash2Qwen3DecoderLayer reads config.dflash_config["conv_kernel_size"] / ["conv_group_size"]
    # (dflash_config only, no top-level fallback) and convolves within blocks of 1 + num_speculative_tokens;
    # qwen3_dflash2.DFlash2Qwen3Model reads dflash_config["selector_rank"] / ["selector_top_k"]; the weights are
    # layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight} and candidate_selector.
    # {predecessor_codebook,successor_codebook,hidden_projection.weight}, the reference's names. SGLang's DFlash2
    # reader was not in the sources consulted: the export writes the reference's and vLLM's names.
    "architectures": ("DFlash2DraftModel selects the DFlash2 drafter", "not verified"),
    "dflash_config.conv_kernel_size": ("taps of the in-block convolution", "not verified"),
    "dflash_config.conv_group_size": ("channels per dynamic tap", "not verified"),
    "dflash_config.selector_rank": ("width of the selector codebooks", "not verified"),
    "dflash_config.selector_top_k": ("candidates per draft position", "not verified"),
}

# Fields an export never writes, because the engines read them differently (or one reads them and the other
# does not), with the value that means "absent". A config setting another value is refused.
ONE_ENGINE_FIELDS: dict[str, object] = {
    "output_multiplier": 1.0, "final_logit_softcapping": None,
    "attention_sink_bias": False, "use_swa": False, "swa_window_size": None, "logit_scale": 1.0,
    "eagle_aux_hidden_state_layer_ids": None,
}

# The single RoPE both engines apply alike: 1-D, rotary dim = head_dim, no scaling.
DRAFTER_ROPE_TYPE = "default"

_GEMMA3 = ("Gemma 3 targets cannot be served faithfully: vLLM feeds the drafter the raw embedding rows, SGLang "
           "feeds them times sqrt(hidden_size) (the target's scaled embedding module), so one drafter cannot "
           "match both; train for another target family")
# target model_type -> why a drafter for it cannot be served as it was trained
UNSERVABLE: dict[str, str] = {"gemma3": _GEMMA3, "gemma3_text": _GEMMA3}


def unservable_reason(target_config) -> str | None:
    """Why a drafter for this target (its config or its text config) cannot be served faithfully, or None."""
    types = {getattr(target_config, "model_type", None)}
    if hasattr(target_config, "get_text_config"):
        types.add(getattr(target_config.get_text_config(), "model_type", None))
    return next((UNSERVABLE[t] for t in sorted(t for t in types if t) if t in UNSERVABLE), None)


def target_rope_theta(target_rope: dict) -> float:
    """The target's full-attention rope_theta (hybrid configs keep one dict per layer type)."""
    if isinstance(target_rope.get("full_attention"), dict):
        target_rope = target_rope["full_attention"]
    return float(target_rope.get("rope_theta", 10000.0))


def drafter_rope_parameters(target_rope: dict) -> dict:
    """The drafter's RoPE for a target: 1-D over the full head_dim with the target's theta, nothing else."""
    return {"rope_type": DRAFTER_ROPE_TYPE, "rope_theta": target_rope_theta(target_rope)}


def check_rope_parameters(rope: dict) -> None:
    """UserError unless ``rope`` is the RoPE both engines apply alike (see the module docstring)."""
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    if rope.get("rope_type", DRAFTER_ROPE_TYPE) != DRAFTER_ROPE_TYPE or extra:
        raise UserError(
            f"rope_parameters {rope}: vLLM applies every RoPE key (partial_rotary_factor, mrope_section, scaling) "
            f"while SGLang rotates the full head_dim from rope_theta alone; use "
            f"{{'rope_type': 'default', 'rope_theta': <theta>}}, the RoPE both apply alike")


def check_one_engine_fields(config: dict, source: str = "config.json") -> None:
    """UserError when a config sets a field that only one engine reads (``ONE_ENGINE_FIELDS``)."""
    dflash = config.get("dflash_config") or {}
    for name, absent in ONE_ENGINE_FIELDS.items():
        value = dflash.get(name, config.get(name, absent))
        if value != absent:
            raise UserError(f"{source}: {name}={value!r} is read by one serving engine only (or differently by "
                            f"each: drafter/serving_rules.py ENGINE_FIELDS); remove it")


def causal_in_block(config: dict, source: str = "config.json") -> bool:
    """Whether a config.json declares the causal-in-block layout: ``is_causal`` (SGLang, the reference) and
    ``dflash_config.causal`` (vLLM) both true. Neither set: False. UserError for anything else, since then the
    engines would run the block differently (one causal, another not)."""
    dflash = config.get("dflash_config") or {}
    pair = {"is_causal": config.get("is_causal"), "dflash_config.causal": dflash.get("causal")}
    for name, value in pair.items():
        if value is not None and not isinstance(value, bool):
            raise UserError(f"{source}: {name} is {value!r}; it must be true or false")
    if pair["is_causal"] is None and pair["dflash_config.causal"] is None:
        return False
    if pair["is_causal"] is True and pair["dflash_config.causal"] is True:
        return True
    raise UserError(f"{source}: is_causal={pair['is_causal']} and dflash_config.causal={pair['dflash_config.causal']}"
                    f": vLLM reads only dflash_config.causal, SGLang and the reference only is_causal, so the engines "
                    f"would run this block differently; set both true for a drafter trained causal inside the "
                    f"block, remove both for one trained non-causal")
