"""The drafter's configuration: one plain dataclass, and its mapping to the exported ``config.json``.

Design choices:
- The drafter's hidden size, vocabulary and head layout default to the target's: the drafter reads the target's
  embeddings and lm_head, so hidden size and vocabulary must match. Its RoPE is 1-D over the full head_dim with
  the target's rope_theta, the one RoPE vLLM and SGLang apply alike (serving_rules.py says what each engine reads).
- ``target_layer_ids`` name decoder layers; the feature of layer i is that layer's output
  (Hugging Face ``hidden_states[i + 1]``). Defaults follow the reference: evenly spaced from layer 1 to L-3.
  They must be strictly increasing: vLLM and SGLang collect the taps in layer order, the reference and
  training concatenate them in list order, so only an increasing list means one feature layout everywhere.
- Defaults and bounds of taps, block size and layer count are defined here once (DEFAULT_*, check_*); a count
  is a whole number (not a string, a bool or 4.7).
- ``config.json`` is read as untrusted input: every field's type is checked first, and a damaged or foreign
  file is one line naming the field (``from_json_dict``); an unknown ``architectures`` or a missing mask token
  id is refused, not guessed.
- The exported config is a Qwen3 config (``model_type: "qwen3"``) plus the DFlash fields; the DFlash fields live
  both at top level and under ``dflash_config``, because vLLM, SGLang and the reference read them from either.
- What differs by kind (``architecture``) the kind says (drafter/kinds/): config.json's ``architectures`` name and
  ``auto_map`` module, and the kind's own fields (DFlash2's four), declared in its file, inherited here through
  ``KindFields``, checked by it and written under ``dflash_config`` only.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from dflashkit.errors import UserError

from . import serving_rules
from .kinds import KINDS, KindFields, by_class_name, kind_for

LAYER_TYPES = ("full_attention", "sliding_attention")


def _target_rope(hf_config: Any) -> dict:
    """The target's RoPE settings in transformers-5 form (legacy rope_theta / rope_scaling converted)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = getattr(hf_config, "rope_scaling", None)
    out = dict(scaling) if isinstance(scaling, dict) else {}
    out["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    return out


# One definition of the drafter's defaults and bounds; everything else (train/config.py, init-drafter, extract)
# imports these.
DEFAULT_BLOCK_SIZE = 16  # the published DFlash drafters' block
DEFAULT_NUM_HIDDEN_LAYERS = 5  # drafter decoder layers
MIN_BLOCK_SIZE = 2  # the anchor plus at least one drafted token


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Evenly spaced taps from layer 1 to L-3: ``round(1 + j*(L-4)/(n-1))``; one tap: ``L // 2``
    (docs/ARCHITECTURE.md).

    The same formula as the reference's and SGLang's ``build_target_layer_ids``, each layer once: a target too
    shallow for n distinct taps gets fewer (the engines collect a layer once, however often it is listed)."""
    if n < 1:
        raise UserError(f"the number of target layers to tap must be >= 1, got {n}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return sorted({round(start + j * (end - start) / (n - 1)) for j in range(n)})


def check_whole_number(value, field: str) -> int:
    """``value`` as an int; UserError naming ``field`` for a string, a bool, a fraction or anything else (a float
    with no fraction, 16.0, is taken as the int it is)."""
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise UserError(f"{field} is {value!r}; it must be a whole number (e.g. 16)")
    return int(value)


def check_target_layer_ids(target_layer_ids, num_target_layers: int | None = None,
                           field: str = "target_layer_ids") -> list[int]:
    """The ids as a list of ints, strictly increasing, each a decoder layer of the target (range checked when
    ``num_target_layers`` is given); UserError naming ``field`` and the fix otherwise.

    Strictly increasing because the engines collect the taps while looping over the target's layers (vLLM's and
    SGLang's aux hidden states come in layer order) while the reference and training concatenate them in list
    order: only an increasing list means the same feature layout everywhere."""
    if isinstance(target_layer_ids, (str, bytes, dict)) or not hasattr(target_layer_ids, "__iter__"):
        raise UserError(f"{field} is {target_layer_ids!r}; it must be a list of decoder layer ids in increasing "
                        f"order, e.g. [1, 9, 17]")
    ids = [check_whole_number(i, f"{field}[{n}]") for n, i in enumerate(target_layer_ids)]
    if not ids:
        raise UserError(f"{field} is empty; name at least one decoder layer, or leave it unset for "
                        "the default (default_target_layer_ids)")
    bad = [i for i in ids if i < 0 or (num_target_layers is not None and i >= num_target_layers)]
    if bad and num_target_layers is None:
        raise UserError(f"{field} {ids}: {bad} negative; a decoder layer id is >= 0")
    if bad:
        raise UserError(f"{field} {ids}: {bad} outside 0..{num_target_layers - 1} (the target has "
                        f"{num_target_layers} decoder layers; id i is layer i's output, HF hidden_states[i + 1]); "
                        f"use ids in that range")
    if len(set(ids)) != len(ids):
        raise UserError(f"{field} {ids} repeats a layer; give each layer once, in increasing order")
    if ids != sorted(ids):
        raise UserError(f"{field} {ids} are not in increasing order: vLLM and SGLang concatenate the taps in layer "
                        f"order, training in list order; list them as {sorted(ids)} (a drafter trained with "
                        f"another order cannot be served as trained)")
    return ids


def check_block_size(block_size: int, field: str = "block_size") -> int:
    block_size = check_whole_number(block_size, field)
    if block_size < MIN_BLOCK_SIZE:
        raise UserError(f"{field} must be >= {MIN_BLOCK_SIZE} (anchor + at least one draft), got {block_size}")
    return block_size


def check_num_hidden_layers(num_hidden_layers: int, field: str = "num_hidden_layers") -> int:
    num_hidden_layers = check_whole_number(num_hidden_layers, field)
    if num_hidden_layers < 1:
        raise UserError(f"{field} (drafter layers) must be >= 1, got {num_hidden_layers}")
    return num_hidden_layers


@dataclass
class DrafterConfig(KindFields):  # + each kind's own fields, keyword-only (drafter/kinds/: config_fields)
    hidden_size: int  # = the target's hidden size (the drafter reads its embeddings and lm_head)
    num_target_layers: int  # decoder layers of the target, used for the default taps and checks
    vocab_size: int  # the target's embedding rows (logits come from the target's lm_head)
    intermediate_size: int = 0  # SwiGLU width; 0 -> the target's
    num_hidden_layers: int = DEFAULT_NUM_HIDDEN_LAYERS  # drafter decoder layers
    num_attention_heads: int = 0  # 0 -> the target's
    num_key_value_heads: int = 0  # GQA groups; 0 -> the target's
    head_dim: int = 0  # 0 -> the target's head_dim, else hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6  # every RMSNorm of the drafter
    max_position_embeddings: int = 32768  # longest position the RoPE tables are meant for
    # 1-D RoPE over the full head_dim with the target's theta: the only RoPE vLLM and SGLang apply alike
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    target_layer_ids: list[int] = field(default_factory=list)  # taps; empty -> default_target_layer_ids
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per drafted block: the anchor plus block_size-1 predictions
    mask_token_id: int | None = None  # id of the MASK filler in the block; must match training and serving
    layer_types: list[str] = field(default_factory=list)  # per drafter layer; empty -> all "full_attention"
    sliding_window: int | None = None  # window of the sliding_attention layers (keys a query may see)
    # True: every layer is causal inside the block (full context), so the first j proposals are the same for any
    # number of speculative tokens k >= j an engine asks for; exported as is_causal + dflash_config.causal
    causal: bool = False
    input_embedding_scale: float = 1.0  # must be 1: the engines feed the block's raw embedding rows (serving_rules.py)
    attention_bias: bool = False  # bias in q/k/v/o projections (Qwen3: none)
    hidden_act: str = "silu"  # SwiGLU activation
    initializer_range: float = 0.02  # std of the random init of linear layers
    architecture: str = "dflash"  # a key of drafter/kinds/ KINDS: the kind (DFlash, DFlash2)

    def __post_init__(self):
        self.num_hidden_layers = check_num_hidden_layers(self.num_hidden_layers)
        if self.architecture not in KINDS:
            raise UserError(f"architecture={self.architecture!r}; use one of {sorted(KINDS)}")
        kind_for(self.architecture).check_config(self)  # the kind's own fields
        self.block_size = check_block_size(self.block_size)
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise UserError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                            f"{self.num_hidden_layers}; give one type per drafter layer")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise UserError(f"layer_types: unknown {sorted(unknown)}; use {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UserError("layer_types has sliding_attention layers but sliding_window is not set")
        if not isinstance(self.causal, bool):
            raise UserError(f"causal={self.causal!r}; it must be true or false")
        if self.mask_token_id is not None:
            self.mask_token_id = check_whole_number(self.mask_token_id, "mask_token_id")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(f"mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                            f"(0..{self.vocab_size - 1}); pick an id the embedding has a row for")
        serving_rules.check_rope_parameters(self.rope_parameters)
        if float(self.input_embedding_scale) != 1.0:
            raise UserError(f"input_embedding_scale={self.input_embedding_scale}: vLLM and SGLang read no such "
                            f"field (drafter/serving_rules.py); a drafter must train on the raw embedding rows")
        if self.hidden_act != "silu":
            raise UserError(f"hidden_act={self.hidden_act!r}; vLLM and SGLang serve DFlash drafters with silu only")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def for_target(cls, target_config: Any, num_hidden_layers: int = DEFAULT_NUM_HIDDEN_LAYERS,
                   block_size: int = DEFAULT_BLOCK_SIZE,
                   target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                   layer_types: list[str] | None = None, sliding_window: int | None = None,
                   input_embedding_scale: float = 1.0, **overrides) -> "DrafterConfig":
        """A drafter sized like the target's layers (the published DFlash drafters are), with the RoPE the
        engines apply (serving_rules.drafter_rope_parameters); UserError for a target that cannot be served
        faithfully."""
        reason = serving_rules.unservable_reason(target_config)
        if reason:
            raise UserError(reason)
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = tc.num_attention_heads
        kw = dict(
            hidden_size=tc.hidden_size, num_target_layers=tc.num_hidden_layers, vocab_size=tc.vocab_size,
            intermediate_size=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            rope_parameters=serving_rules.drafter_rope_parameters(_target_rope(tc)),
            target_layer_ids=list(target_layer_ids or []),
            block_size=block_size, mask_token_id=mask_token_id, layer_types=list(layer_types or []),
            sliding_window=sliding_window, input_embedding_scale=float(input_embedding_scale))
        kw.update(overrides)
        return cls(**kw)

    def resolved(self) -> "DrafterConfig":
        """Fill the 0 = "like the target" fields (only meaningful when built without for_target)."""
        c = dataclasses.replace(self)
        c.num_attention_heads = c.num_attention_heads or max(1, c.hidden_size // 64)
        c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
        c.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        c.intermediate_size = c.intermediate_size or 4 * c.hidden_size
        return c

    # ---------------------------------------------------------------- config.json
    def to_json_dict(self) -> dict:
        """The exported config.json: Qwen3 fields + DFlash fields (top level and dflash_config)."""
        c = self.resolved()
        rope = dict(c.rope_parameters)
        sliding = "sliding_attention" in c.layer_types
        kind = kind_for(c.architecture)
        arch = kind.class_name  # the name engines serve it under; auto_map: the class and its file
        own = {k: int(getattr(c, k)) for k in kind.config_fields}  # the kind's own fields
        # causal-in-block: vLLM reads dflash_config.causal, SGLang and the reference the top-level is_causal
        # (drafter/serving_rules.py); both are written, and neither for the non-causal default
        causal = {"causal": True} if c.causal else {}
        return {
            "architectures": [arch],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": kind.auto_map},
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps, "attention_bias": c.attention_bias,
            "attention_dropout": 0.0, "initializer_range": c.initializer_range,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "tie_word_embeddings": False, "use_cache": True,
            "rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": None,
            "layer_types": list(c.layer_types), "use_sliding_window": sliding,
            "sliding_window": c.sliding_window, "max_window_layers": c.num_hidden_layers,
            "block_size": c.block_size, "num_target_layers": c.num_target_layers,
            "target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                              "block_size": c.block_size, **own, **causal},  # the kind's fields: here only
            **({"is_causal": True} if c.causal else {}),
            "torch_dtype": "bfloat16", "dtype": "bfloat16",
            **kind.extra_json_fields(c),  # DSpark: markov_rank and its serving fields, where vLLM reads them
        }

    @classmethod
    def from_json_dict(cls, d: dict, source: str = "config.json") -> "DrafterConfig":
        """Read our export or a reference-format drafter config (DFlash fields top level or in dflash_config).
        Every field's type is checked first (``_checked_fields``), so a damaged file is one line naming the field."""
        d, dflash = _checked_fields(d, source)
        serving_rules.check_one_engine_fields(d, source)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if d.get(k) is None]
        if missing:
            raise UserError(f"{source}: missing field(s) {missing}; is this a DFlash drafter config.json?")
        raw_ids, where = _dflash_field(d, dflash, "target_layer_ids")
        ids = [] if raw_ids is None else check_target_layer_ids(raw_ids, field=f"{source}: {where}")
        if "num_target_layers" not in d and not ids:
            raise UserError(f"{source}: needs num_target_layers or dflash_config.target_layer_ids")
        mask_token_id, where = _dflash_field(d, dflash, "mask_token_id")
        if mask_token_id is None:
            raise UserError(f"{source}: no mask_token_id (dflash_config.mask_token_id); a drafter cannot draft "
                            f"without the id of the MASK token it was trained with: set it to that id")
        mask_token_id = check_whole_number(mask_token_id, f"{source}: {where}")
        block_size, where = _dflash_field(d, dflash, "block_size", DEFAULT_BLOCK_SIZE)
        block_size = check_block_size(block_size, f"{source}: {where}")
        architecture = _architecture(d, source)
        own = _kind_fields(d, dflash, architecture, source)
        layer_types = list(d.get("layer_types") or [])
        causal = serving_rules.causal_in_block(d, source)
        try:
            return cls(
                hidden_size=d["hidden_size"], num_target_layers=d.get("num_target_layers") or (max(ids) + 4),
                vocab_size=d["vocab_size"], intermediate_size=d.get("intermediate_size", 0),
                num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                max_position_embeddings=d.get("max_position_embeddings", 32768), rope_parameters=_json_rope(d),
                target_layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id, layer_types=layer_types,
                sliding_window=d.get("sliding_window") if "sliding_attention" in layer_types else None,
                input_embedding_scale=float(_dflash_field(d, dflash, "input_embedding_scale", 1.0)[0]),
                attention_bias=bool(d.get("attention_bias", False)), hidden_act=d.get("hidden_act", "silu"),
                initializer_range=d.get("initializer_range", 0.02), architecture=architecture, causal=causal,
                **own)
        except ValueError as e:
            raise UserError(f"{source}: {e}") from None

    def to_hf(self):
        """A transformers Qwen3Config carrying the DFlash fields (what DFlashDraftModel is built from)."""
        from transformers import Qwen3Config

        d = self.to_json_dict()
        for k in ("architectures", "model_type", "torch_dtype", "dtype", "rope_theta", "rope_scaling"):
            d.pop(k)
        return Qwen3Config(**d)


# ----------------------------------------------------------------------------- reading config.json
# config.json fields that must hold a whole number when present (>= 1 for the first four); their other bounds are
# DrafterConfig's checks
JSON_WHOLE_FIELDS = ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers", "intermediate_size",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "num_target_layers",
                     "sliding_window")
JSON_REAL_FIELDS = ("rms_norm_eps", "initializer_range", "rope_theta")  # numbers when present
JSON_LIST_FIELDS = ("architectures", "layer_types")  # lists of names when present


def _checked_fields(d, source: str) -> tuple[dict, dict]:
    """config.json's top level (whole-number fields as ints) and its ``dflash_config`` ({} when absent), after
    checking the type of every field read from them; UserError naming ``source`` and the field otherwise."""
    if not isinstance(d, dict):
        raise UserError(f"{source} holds a JSON {type(d).__name__}, not an object of config fields; it is not a "
                        f"drafter config.json: restore it or export the drafter again")
    dflash = d.get("dflash_config")
    if dflash is not None and not isinstance(dflash, dict):
        raise UserError(f"{source}: dflash_config is {dflash!r}; it must be an object such as "
                        '{"mask_token_id": 5, "target_layer_ids": [1, 9, 17], "block_size": 16}')
    d = dict(d)
    for n, name in enumerate(JSON_WHOLE_FIELDS):
        if d.get(name) is not None:
            d[name] = check_whole_number(d[name], f"{source}: {name}")
            if n < 4 and d[name] < 1:
                raise UserError(f"{source}: {name} is {d[name]}; it must be >= 1")
    for name in JSON_REAL_FIELDS:
        if d.get(name) is not None and (isinstance(d[name], bool) or not isinstance(d[name], (int, float))):
            raise UserError(f"{source}: {name} is {d[name]!r}; it must be a number")
    for name in JSON_LIST_FIELDS:
        value = d.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UserError(f"{source}: {name} is {value!r}; it must be a list of names")
    return d, dflash or {}


def _dflash_field(d: dict, dflash: dict, name: str, default=None) -> tuple[Any, str]:
    """A DFlash field's value and where it was read: ``dflash_config`` first, else the top level (the engines
    and the reference read either)."""
    if name in dflash:
        return dflash[name], f"dflash_config.{name}"
    return d.get(name, default), name


def _architecture(d: dict, source: str) -> str:
    """The architecture ``architectures`` names; none named (a bare Qwen3 config dict) is read as DFlash."""
    names = d.get("architectures") or []
    if names and (len(set(names)) != 1 or by_class_name(names[0]) is None):
        raise UserError(f"{source}: architectures {names} is not a DFlash drafter; it must be one of "
                        f"{[[kind.class_name] for kind in KINDS.values()]}")
    return by_class_name(names[0]).architecture if names else "dflash"


def _kind_fields(d: dict, dflash: dict, architecture: str, source: str) -> dict:
    """The kind's own fields of a config naming it, each a whole number and all required."""
    kind = kind_for(architecture)
    out = {}
    for name in kind.config_fields:
        value, where = _dflash_field(d, dflash, name)
        if value is None:
            raise UserError(f"{source}: a {kind.class_name} config needs dflash_config.{name} "
                            f"(all of {list(kind.config_fields)})")
        out[name] = check_whole_number(value, f"{source}: {where}")
    return out


def _json_rope(d: dict) -> dict:
    """rope_parameters, or the legacy rope_theta / rope_scaling in that form."""
    rope = d.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        scaling = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
        rope = {**scaling, "rope_theta": float(d.get("rope_theta", 10000.0))}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    return rope
