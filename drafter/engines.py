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
- vLLM 0.24 serving rules (``VLLM_024_RULES``, each citing the vLLM file): a tap of the target's last layer is read
  before its final norm, sliding-window drafter layers run as full attention (both refused by ``export --for
  vllm``, warned otherwise and by ``eval --engine vllm``), num_speculative_tokens must be block_size - 1 by hand,
  and a GGUF quantization_config in the target's config.json is stripped in a copy (``vllm_target_dir``).
- vLLM 0.28 DFlash2 rules (``VLLM_028_DFLASH2_RULES``, each citing the 0.28 file; 0.28 needs torch 2.13, so they
  are checked against its source in a CPU test, not run): the four DFlash2 fields under ``dflash_config``, the
  weights it loads by name and shape (``vllm028_dflash2_problems``), num_speculative_tokens = block_size - 1 and no
  per-batch-size schedule (``check_vllm_num_speculative_tokens``, ``check_vllm_schedule``). 0.28 also applies
  ``dflash_config.input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping`` to a DFlash2
  drafter: left at their defaults, as trained.
- Nothing else. Fields that only one engine reads (``output_multiplier``, ``final_logit_softcapping``,
  ``attention_sink_bias``, ``use_swa``, ``swa_window_size``, ``logit_scale``) are never written and are refused
  when a config to be trained or evaluated sets them.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.files import atomic_write
from dflashkit.untrusted import contained_file

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
    # attention; VLLM_024_RULES["sliding_window"]). models/dflash._get_dflash_layer_attention_params (:166-191):
    # full -> ENCODER_ONLY (non-causal) unless is_causal, sliding -> DECODER (causal) with window_left =
    # sliding_window - 1; without layer_types every layer is non-causal and is_causal is ignored (:170-171)
    "layer_types": ("not read (0.24): every layer full attention",
                    "per layer: full (non-causal) or sliding (causal, windowed)"),
    "sliding_window": ("not read (0.24)", "keys a sliding query sees, itself included"),
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
                            f"each: drafter/engines.py ENGINE_FIELDS); remove it")


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


# ----------------------------------------------------------------------------- vLLM 0.24 serving rules
# What vLLM 0.24.0 does that a drafter trained by dflashkit must be checked against, one row per rule:
# rule -> (what vLLM 0.24 does, where in its wheel's vllm/ it is). `check_export_for` and `vllm_warnings` act on
# them; `vllm_num_speculative_tokens` and `vllm_target_dir` are what `dflashkit eval --engine vllm` applies.
VLLM_024_RULES: dict[str, tuple[str, str]] = {
    "last_layer_tap": ("id L-1 is captured as hidden + residual before the final norm, where dflashkit and the "
                       "reference read the final-norm output (HF hidden_states[L])",
                       "model_executor/models/llama.py:411-420,427; qwen2.py:407-414,421; "
                       "models/interfaces.py:1335-1337"),
    "sliding_window": ("layer_types / sliding_window are not read: every drafter layer is full attention",
                       "model_executor/models/qwen3_dflash.py:112-121"),
    "block_size": ("block_size is not read; num_speculative_tokens is required and 1 + N tokens are queried per "
                   "step, so N = block_size - 1 must be set by hand",
                   "config/speculative.py:821-825; v1/spec_decode/dflash.py:109; "
                   "v1/worker/gpu/spec_decode/dflash/speculator.py:43"),
    "gguf_quantization_config": ("a target config.json whose quantization_config has quant_method gguf sends the "
                                 "model down the GGUF loader", "config/model.py:976-1041"),
}
VLLM_VERSION = "0.24"  # the release the rules above were read from
ENGINE_CHOICES = ("all", "vllm")  # `dflashkit export --for`: every engine, or vLLM 0.24 only


def last_layer_tap_reason(target_layer_ids, num_target_layers: int) -> str | None:
    """Why vLLM 0.24 would feed this drafter a different feature than it trained on (id L-1), or None."""
    last = int(num_target_layers) - 1
    if last not in [int(i) for i in target_layer_ids]:
        return None
    return (f"target_layer_ids {list(target_layer_ids)} include {last}, the target's last layer: vLLM "
            f"{VLLM_VERSION} captures it before the final norm while training read it after "
            f"({VLLM_024_RULES['last_layer_tap'][1]}); train with ids below {last} (the default ids stop at L-3)")


def sliding_window_reason(layer_types) -> str | None:
    """Why vLLM 0.24 serves this drafter differently from its training (sliding-window layers), or None."""
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if not sliding:
        return None
    return (f"drafter layers {sliding} are sliding_attention: vLLM {VLLM_VERSION} ignores layer_types and "
            f"sliding_window and serves them as full attention ({VLLM_024_RULES['sliding_window'][1]}), so "
            f"acceptance there is lower than trained; train with full_attention layers for vLLM")


def vllm_warnings(config) -> list[str]:
    """What vLLM 0.24 would serve differently from training, for a DrafterConfig (empty when nothing)."""
    reasons = [last_layer_tap_reason(config.target_layer_ids, config.num_target_layers),
               sliding_window_reason(config.layer_types)]
    return [r for r in reasons if r]


def check_export_for(config, engine: str = "all", warn=print) -> None:
    """Act on the vLLM rules at export: for ``engine="vllm"`` a rule that vLLM 0.24 breaks is a UserError; for
    every engine ("all") it is a warning passed to ``warn``."""
    if engine not in ENGINE_CHOICES:
        raise UserError(f"--for {engine!r}: choose one of {', '.join(ENGINE_CHOICES)}")
    for reason in vllm_warnings(config):
        if engine == "vllm":
            raise UserError(f"export for vLLM refused: {reason}")
        warn(f"warning: {reason}")


def vllm_num_speculative_tokens(block_size: int, requested: int | None = None, warn=print,
                                causal: bool = False) -> int:
    """num_speculative_tokens for vLLM: block_size - 1 unless ``requested`` says otherwise. Another value warns
    for a non-causal drafter (its block attention sees every mask token, so its proposals change with their
    number); a causal-in-block drafter (dflash_config.causal) proposes its first k tokens identically for any
    k <= block_size - 1, so only a larger k warns (positions it was never trained on)."""
    default = int(block_size) - 1
    if requested is None or int(requested) == default:
        return default
    if int(requested) < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1, got {requested}")
    if int(requested) > default:
        warn(f"warning: --num-speculative-tokens {requested} > block_size - 1 = {default}: the drafter was never "
             f"trained to propose past position {default}, so acceptance changes")
    elif not causal:
        warn(f"warning: --num-speculative-tokens {requested} differs from block_size - 1 = {default}: a DFlash "
             f"drafter proposes differently with another number of mask tokens, so acceptance changes (it was "
             f"trained on blocks of {block_size}; a causal-in-block drafter, `causal: true`, would not)")
    return int(requested)


def vllm_serve_command(target: str, drafter: str, block_size: int, speculative_config: dict | None = None) -> str:
    """The `vllm serve` line for a drafter: num_speculative_tokens = block_size - 1 (vLLM reads no block_size),
    or the given speculative_config (a per-batch-size schedule's). A DFlash2 export is checked against vLLM 0.28
    first (``dflash2_serve_note``: no schedule, N = block_size - 1) and the line names the vLLM that serves it."""
    spec = speculative_config or {"method": "dflash", "model": str(drafter),
                                  "num_speculative_tokens": int(block_size) - 1}
    note = dflash2_serve_note(drafter, spec)
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'{note}"


def is_gguf_quantized(config: dict) -> bool:
    """True when a target config.json carries the GGUF quantization_config that save_pretrained leaves."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "gguf"


def vllm_target_dir(target_dir, scratch) -> tuple[Path, bool]:
    """(directory to give vLLM, whether it is a stripped copy). A target whose config.json has a GGUF
    quantization_config is served from a copy under ``scratch``: every other file symlinked, config.json
    rewritten without that key (the weights there are already plain tensors)."""
    source = Path(target_dir)
    config = json.loads((source / "config.json").read_text())
    if not is_gguf_quantized(config):
        return source, False
    copy = Path(scratch) / f"{source.name}-without-gguf-config"
    copy.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json" and not (copy / item.name).exists():
            (copy / item.name).symlink_to(item.resolve())
    del config["quantization_config"]
    atomic_write(copy / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return copy, True


# ----------------------------------------------------------------------------- vLLM 0.28 DFlash2 rules
# What vLLM 0.28.0 (the first release that serves DFlash2) reads of a DFlash2 drafter, one row per rule:
# rule -> (what vLLM 0.28 does, where in its wheel's vllm/ it is). `vllm028_dflash2_problems` checks an export
# directory against them (config.json and the safetensors headers only); `check_vllm_num_speculative_tokens` and
# `check_vllm_schedule` check the serve settings; `vllm_serve_command` applies all three to a DFlash2 drafter.
VLLM_028_DFLASH2_RULES: dict[str, tuple[str, str]] = {
    "architecture": ("architectures DFlash2DraftModel selects the DFlash2 drafter and its speculator; the method "
                     "stays \"dflash\"; it always runs on the V2 model runner, the only one with the selector",
                     "model_executor/models/registry.py:628; v1/worker/gpu/spec_decode/__init__.py:11-17; "
                     "config/vllm.py:639-643; transformers_utils/configs/eagle.py:65-73"),
    "conv_fields": ("dflash_config.conv_kernel_size and conv_group_size: read with int(), no default, not from "
                    "the top level; conv_group_size must divide hidden_size",
                    "model_executor/models/qwen3_dflash2.py:57-60,123-129"),
    "selector_fields": ("dflash_config.selector_rank and selector_top_k: read with int(), no default, not from "
                        "the top level; the selector walks the top selector_top_k logits of each position",
                        "model_executor/models/qwen3_dflash2.py:250-263,282-287; "
                        "v1/worker/gpu/spec_decode/dflash2/speculator.py:114-115"),
    "neutral_fields": ("dflash_config.input_embedding_scale (default 1.0) scales the block's embedding, "
                       "output_multiplier (1.0) and final_logit_softcapping (none) the candidates' logits; "
                       "dflashkit trains at those defaults and never writes them",
                       "model_executor/models/qwen3_dflash2.py:251-253,265-266,274-280"),
    "weights": ("DFlash's tensors plus layers.{i}.{attention,mlp}_conv.base_kernel [2, K, H], "
                "layers.{i}.{attention,mlp}_conv.kernel_projection.weight [2*K*H/G, H], "
                "candidate_selector.{predecessor,successor}_codebook [V, R], "
                "candidate_selector.hidden_projection.weight [R, H]; names get \"model.\" prefixed; an unknown name "
                "or a parameter left unloaded fails the load, a shape mismatch asserts",
                "model_executor/models/qwen3_dflash2.py:65-77,200-214; qwen3_dflash.py:98-107,381-397,816-859; "
                "models/utils.py:384-394; model_loader/default_loader.py:465-470; "
                "model_loader/weight_utils.py:1231-1234; layers/linear.py:373-376"),
    "block_size": ("the convolution's block is 1 + num_speculative_tokens, fixed when the drafter is built, with "
                   "positions counted modulo it over the step's flattened tokens; every request queries 1 + N "
                   "tokens; block_size is not read, so N = block_size - 1",
                   "model_executor/models/qwen3_dflash2.py:34-39,126-133; "
                   "v1/worker/gpu/spec_decode/dflash/speculator.py:46; config/speculative.py:1082-1086,1351-1362"),
    "schedule": ("num_speculative_tokens_per_batch_size is accepted with no DFlash2 check: the scheduler picks "
                 "k per step, the V1 proposer then queries 1 + k tokens per request against a convolution built "
                 "for 1 + N (so each request's block is misaligned), and the V2 runner drafts the whole block and "
                 "trims it to k; dflashkit refuses it for DFlash2",
                 "config/speculative.py:181-186; v1/core/sched/scheduler.py:257-263,710-716,1254-1258; "
                 "v1/spec_decode/llm_base_proposer.py:530; v1/spec_decode/dflash.py:134"),
}
VLLM_DFLASH2_VERSION = "0.28"  # the first vLLM that serves DFlash2; the rules above were read from it
VLLM_028_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# dflash_config fields 0.28 applies to a DFlash2 drafter, with the value that leaves the drafter as trained
VLLM_028_DFLASH2_NEUTRAL: dict[str, object] = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                                               "final_logit_softcapping": None}
SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"  # vLLM's speculative_config key of the schedule
_HEADER_LIMIT = 100 * 1024 * 1024  # a safetensors header larger than this is a damaged file


def vllm028_dflash2_problems(drafter_dir, num_speculative_tokens: int | None = None) -> list[str]:
    """What vLLM 0.28 would refuse, or serve differently from training, in the DFlash2 export ``drafter_dir``:
    one line per problem, each naming the file, the field or tensor and the fix (empty when it serves as
    trained). Reads config.json and the safetensors headers only, never a tensor. With ``num_speculative_tokens``
    the serve setting is checked too (``VLLM_028_DFLASH2_RULES["block_size"]``)."""
    directory = Path(drafter_dir)
    cfg_file = directory / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{cfg_file}: not a readable JSON file ({type(e).__name__}); export the drafter again"]
    if not isinstance(config, dict) or "DFlash2DraftModel" not in (config.get("architectures") or []):
        return [f"{cfg_file}: architectures is not [\"DFlash2DraftModel\"], so vLLM "
                f"{VLLM_DFLASH2_VERSION} does not build a DFlash2 drafter "
                f"({VLLM_028_DFLASH2_RULES['architecture'][1]}); export a drafter trained with architecture=dflash2"]
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return [f"{cfg_file}: dflash_config is missing or not an object; vLLM {VLLM_DFLASH2_VERSION} reads every "
                f"DFlash2 field from it; export the drafter again"]
    problems = _dflash2_field_problems(cfg_file, config, dflash)
    if not problems:  # the weights' shapes follow from those fields: check them once the fields are right
        problems += _dflash2_weight_problems(directory, config, dflash)
    block_size = _dflash2_block_size(config, dflash)
    if block_size is None:
        problems.append(f"{cfg_file}: dflash_config.block_size is missing or not a whole number >= 2: the trained "
                        f"block is unknown, so num_speculative_tokens = block_size - 1 cannot be set; set it to the "
                        f"block the drafter was trained on")
    elif num_speculative_tokens is not None and int(num_speculative_tokens) != block_size - 1:
        problems.append(_num_speculative_tokens_refusal(block_size, num_speculative_tokens))
    return problems


def check_vllm028_dflash2(drafter_dir, num_speculative_tokens: int | None = None) -> None:
    """UserError (one line: the first problem and how many more) when ``vllm028_dflash2_problems`` finds any."""
    problems = vllm028_dflash2_problems(drafter_dir, num_speculative_tokens)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError(f"DFlash2 drafter not servable by vLLM {VLLM_DFLASH2_VERSION}: {problems[0]}{more}")


def check_vllm_num_speculative_tokens(dcfg, requested: int | None) -> None:
    """UserError when a DFlash2 drafter (a DrafterConfig) would be served with num_speculative_tokens other than
    block_size - 1 (``VLLM_028_DFLASH2_RULES["block_size"]``); None (unset) or any value for a DFlash drafter
    passes (``vllm_num_speculative_tokens`` warns for those)."""
    if dcfg.architecture == "dflash2":
        _refuse_dflash2_num_speculative_tokens(int(dcfg.block_size), requested)


def check_vllm_schedule(dcfg, schedule) -> None:
    """UserError when a per-batch-size schedule (``num_speculative_tokens_per_batch_size``: a list of
    ``[first, last, k]``, or a speculative_config holding one) is given for a DFlash2 drafter
    (``VLLM_028_DFLASH2_RULES["schedule"]``); a DFlash drafter's schedule passes."""
    if dcfg.architecture == "dflash2":
        _refuse_dflash2_schedule(int(dcfg.block_size), schedule)


def dflash2_serve_note(drafter, speculative_config: dict) -> str:
    """For `vllm_serve_command`: "" unless ``drafter`` is a DFlash2 export directory; then its serve settings and
    the directory are checked against vLLM 0.28 (UserError on the first problem) and the note says which vLLM
    serves it."""
    cfg_file = Path(drafter) / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""  # no drafter written there (a placeholder name): nothing to check
    if not isinstance(config, dict) or "DFlash2DraftModel" not in (config.get("architectures") or []):
        return ""
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    block_size = _dflash2_block_size(config, dflash)
    if block_size is not None:
        _refuse_dflash2_schedule(block_size, speculative_config)
        _refuse_dflash2_num_speculative_tokens(block_size, speculative_config.get("num_speculative_tokens"))
    check_vllm028_dflash2(drafter)
    return f"  # DFlash2: vLLM >= {VLLM_DFLASH2_VERSION}"


def _refuse_dflash2_num_speculative_tokens(block_size: int, requested) -> None:
    if requested is not None and int(requested) != block_size - 1:
        raise UserError(_num_speculative_tokens_refusal(block_size, requested))


def _refuse_dflash2_schedule(block_size: int, schedule) -> None:
    if isinstance(schedule, dict):
        schedule = schedule.get(SCHEDULE_FIELD)
    if schedule:
        raise UserError(f"{SCHEDULE_FIELD} {schedule}: refused for a DFlash2 drafter: vLLM {VLLM_DFLASH2_VERSION} "
                        f"builds its convolution for blocks of 1 + num_speculative_tokens and a schedule's smaller k "
                        f"changes the block it drafts ({VLLM_028_DFLASH2_RULES['schedule'][1]}); serve it with the "
                        f"fixed num_speculative_tokens = block_size - 1 = {block_size - 1} and no schedule")


def _num_speculative_tokens_refusal(block_size: int, requested) -> str:
    return (f"num_speculative_tokens={requested}: a DFlash2 drafter trained on blocks of {block_size} must be "
            f"served with num_speculative_tokens = block_size - 1 = {block_size - 1}: vLLM {VLLM_DFLASH2_VERSION} "
            f"builds its convolution for blocks of 1 + num_speculative_tokens "
            f"({VLLM_028_DFLASH2_RULES['block_size'][1]}); set --num-speculative-tokens {block_size - 1} (or leave "
            f"it unset)")


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dflash2_block_size(config: dict, dflash: dict) -> int | None:
    """The trained block (dflash_config.block_size, else the top-level block_size), or None when unusable."""
    value = dflash.get("block_size", config.get("block_size"))
    return value if _is_whole(value) and value >= 2 else None


def _dflash2_field_problems(cfg_file: Path, config: dict, dflash: dict) -> list[str]:
    """The config.json fields vLLM 0.28 needs for a DFlash2 drafter, each present with the right type."""
    problems = []
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size"):
        if not _is_whole(config.get(name)) or config[name] < 1:
            problems.append(f"{cfg_file}: {name} is {config.get(name)!r}; vLLM {VLLM_DFLASH2_VERSION} builds the "
                            f"drafter from it: set the drafter's {name} (a whole number >= 1)")
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or not all(_is_whole(i) for i in ids):
        problems.append(f"{cfg_file}: dflash_config.target_layer_ids is {ids!r}; vLLM {VLLM_DFLASH2_VERSION} sizes "
                        f"fc and the taps from it (model_executor/models/qwen3_dflash.py:98-107): set the layer ids "
                        f"the drafter was trained on")
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if not _is_whole(mask):
        problems.append(f"{cfg_file}: dflash_config.mask_token_id is {mask!r}; vLLM {VLLM_DFLASH2_VERSION} fills "
                        f"the block's draft slots with it: set the MASK id the drafter was trained with")
    for name in VLLM_028_DFLASH2_FIELDS:
        value = dflash.get(name)
        if not _is_whole(value) or value < 1:
            where = " (it is read from dflash_config only, not the top level)" if name in config else ""
            state = "is missing" if value is None else f"is {value!r}"
            problems.append(f"{cfg_file}: dflash_config.{name} {state}{where}; vLLM {VLLM_DFLASH2_VERSION} "
                            f"reads it with no default ({VLLM_028_DFLASH2_RULES['conv_fields'][1]}; "
                            f"{VLLM_028_DFLASH2_RULES['selector_fields'][1]}): set it to the trained whole number")
    hidden, group = config.get("hidden_size"), dflash.get("conv_group_size")
    if _is_whole(hidden) and _is_whole(group) and group >= 1 and hidden % group:
        problems.append(f"{cfg_file}: dflash_config.conv_group_size={group} does not divide hidden_size={hidden}; "
                        f"vLLM {VLLM_DFLASH2_VERSION} refuses it (model_executor/models/qwen3_dflash2.py:57-60)")
    vocab, top_k = config.get("vocab_size"), dflash.get("selector_top_k")
    if _is_whole(vocab) and _is_whole(top_k) and top_k > vocab:
        problems.append(f"{cfg_file}: dflash_config.selector_top_k={top_k} exceeds vocab_size={vocab}; the "
                        f"selector takes the top selector_top_k logits: set it <= vocab_size")
    for name, neutral in VLLM_028_DFLASH2_NEUTRAL.items():
        value = dflash.get(name, neutral)
        if value != neutral and not (name == "final_logit_softcapping" and not value):
            problems.append(f"{cfg_file}: dflash_config.{name}={value!r}; vLLM {VLLM_DFLASH2_VERSION} applies it to "
                            f"a DFlash2 drafter ({VLLM_028_DFLASH2_RULES['neutral_fields'][1]}) while dflashkit "
                            f"trains without it: remove it")
    return problems


def _dflash2_weight_problems(directory: Path, config: dict, dflash: dict) -> list[str]:
    """Every tensor vLLM 0.28 loads present with the shape it builds, and no other (safetensors headers only)."""
    problems: list[str] = []
    weights, found = _header_shapes(directory, problems)
    if problems:
        return problems
    expected = _dflash2_expected_shapes(config, dflash)
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{weights}: tensor {name} is missing; vLLM {VLLM_DFLASH2_VERSION} fails the load on a "
                            f"parameter the checkpoint lacks ({VLLM_028_DFLASH2_RULES['weights'][1]}); export the "
                            f"drafter again")
        elif tuple(found[name]) != shape:
            problems.append(f"{weights}: tensor {name} has shape {tuple(found[name])} where vLLM "
                            f"{VLLM_DFLASH2_VERSION} builds {shape} from config.json; make config.json match the "
                            f"weights (hidden_size, heads, head_dim, target_layer_ids, the DFlash2 fields)")
    problems += [f"{weights}: tensor {name} is not a DFlash2 parameter; vLLM {VLLM_DFLASH2_VERSION} refuses "
                 f"unknown names (models/utils.py:384-394); remove it" for name in sorted(set(found) - set(expected))]
    return problems


def _dflash2_expected_shapes(config: dict, dflash: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM 0.28 loads into a DFlash2 drafter, by checkpoint name, with the shape it builds from
    config.json (the fields are checked first: ``_dflash2_field_problems``)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, taps = config["intermediate_size"], dflash["conv_kernel_size"]
    rank, groups = dflash["selector_rank"], hidden // dflash["conv_group_size"]
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    feature = config.get("target_hidden_size") or hidden
    shapes = {"fc.weight": (hidden, feature * len(ids)), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
              "candidate_selector.predecessor_codebook": (vocab, rank),
              "candidate_selector.successor_codebook": (vocab, rank),
              "candidate_selector.hidden_projection.weight": (rank, hidden)}
    projections = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                   "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, shape in projections.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if config.get("attention_bias"):  # q/k/v and o_proj carry a bias then
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes.update({f"{p}self_attn.q_norm.weight": (head_dim,), f"{p}self_attn.k_norm.weight": (head_dim,),
                       f"{p}mlp.gate_proj.weight": (inter, hidden), f"{p}mlp.up_proj.weight": (inter, hidden),
                       f"{p}mlp.down_proj.weight": (hidden, inter), f"{p}input_layernorm.weight": (hidden,),
                       f"{p}post_attention_layernorm.weight": (hidden,)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{p}{conv}.base_kernel"] = (2, taps, hidden)
            shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
    return shapes


def _header_shapes(directory: Path, problems: list[str]) -> tuple[Path, dict[str, list[int]]]:
    """(where the weights are, tensor name -> shape) from the safetensors headers: the files
    model.safetensors.index.json names, else model.safetensors. A file that cannot be read adds a problem."""
    index = directory / "model.safetensors.index.json"
    files = [directory / "model.safetensors"]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({contained_file(directory, f, source=index, field=f"weight_map[{n!r}]")
                            for n, f in weight_map.items()})
        except (UserError, OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{index}: not a readable weight index ({e}); export the drafter again")
            return index, {}
    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            shapes.update(_safetensors_header(f))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{f}: not a readable safetensors file ({e}); export the drafter again")
    return (files[0] if len(files) == 1 else index), shapes


def _safetensors_header(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's JSON header (8-byte little-endian length, then the JSON);
    no tensor data is read. ValueError for a file that is not one."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= _HEADER_LIMIT:
            raise ValueError(f"header length {size}")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return {name: [int(d) for d in entry["shape"]] for name, entry in header.items() if name != "__metadata__"}
