"""What vLLM 0.28 (the first release that serves DFlash2) reads of a DFlash2 drafter, and the checks dflashkit
applies before printing a serve command or serving one (drafter/vllm_rules.py holds the DFlash rules of vLLM 0.24 and
0.26, drafter/serving_rules.py what SGLang reads; this module the DFlash2 ones, checked against 0.28's source in a
CPU test, not run: 0.28 needs torch 2.13).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.untrusted import contained_file

from .kinds import kind_for

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
    if kind_for(dcfg.architecture).whole_block_only:
        _refuse_dflash2_num_speculative_tokens(int(dcfg.block_size), requested)


def check_vllm_schedule(dcfg, schedule) -> None:
    """UserError when a per-batch-size schedule (``num_speculative_tokens_per_batch_size``: a list of
    ``[first, last, k]``, or a speculative_config holding one) is given for a DFlash2 drafter
    (``VLLM_028_DFLASH2_RULES["schedule"]``); a DFlash drafter's schedule passes."""
    if kind_for(dcfg.architecture).whole_block_only:
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
