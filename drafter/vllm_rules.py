"""What vLLM does with a DFlash export, release by release: the one place that says it.

``VLLM_RULES`` holds one table per release (``VLLM_024_RULES`` and ``VLLM_026_RULES``, each row citing the vLLM
file of that release); what both engines compute alike, and the fields only one reads, are drafter/serving_rules.py.
The rules are acted on for the INSTALLED vLLM (``installed_vllm_version``; 0.26, the engine the project serves with,
when none is installed): a tap of the target's last layer is read before its final norm (both; refused by
``export --for vllm``, warned otherwise and by ``eval --engine vllm``); sliding-window drafter layers run as full
attention on 0.24 (refused and warned the same way) and as trained on 0.26; a per-batch-size schedule runs on the V1
model runner on 0.24 and on V2 on 0.26 (``schedule_runner``); a drafter mixing sliding and full layers forces V2 on
0.26; num_speculative_tokens must be block_size - 1 by hand (``vllm_num_speculative_tokens``,
``vllm_serve_command``); a GGUF quantization_config in the target's config.json is stripped in a copy
(``vllm_target_dir``). vLLM 0.28's DFlash2 rules are drafter/vllm_dflash2.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.files import atomic_write

# What vLLM does that a drafter trained by dflashkit must be checked against, one table per release and one row per
# rule: rule -> (what that release does, where in its wheel's vllm/ it is; ../shared/vllm-0.24/README.md and
# ../shared/vllm/README.md). `check_export_for` and `vllm_warnings` act on the table of the version given (the
# installed vLLM's, ``installed_vllm_version``); `vllm_num_speculative_tokens` and `vllm_target_dir` are what
# `dflashkit eval --engine vllm` applies.
VLLM_024_RULES: dict[str, tuple[str, str]] = {
    "last_layer_tap": ("id L-1 is captured as hidden + residual before the final norm, where dflashkit and the "
                       "reference read the final-norm output (HF hidden_states[L])",
                       "model_executor/models/llama.py:411-420,427; qwen2.py:407-414,421; "
                       "models/interfaces.py:1335-1337"),
    "sliding_window": ("layer_types / sliding_window are not read: every drafter layer is full attention",
                       "model_executor/models/qwen3_dflash.py:112-121"),
    "mixed_layers": ("not read (every layer full attention): any runner serves the drafter",
                     "model_executor/models/qwen3_dflash.py:112-121"),
    "schedule_runner": ("a per-batch-size schedule (num_speculative_tokens_per_batch_size) runs on the V1 model "
                        "runner: V2 lists dynamic speculative decoding as unsupported; piecewise CUDA graphs",
                        "config/vllm.py:2034-2035, 758-773"),
    "zero_k_range": ("a schedule's k = 0 range still queries one token a request and runs the drafter's pass",
                     "v1/spec_decode/llm_base_proposer.py:463, 538-547"),
    "dspark": ("no DSpark: the only block-drafter method is dflash", "config/speculative.py:56"),
    "block_size": ("block_size is not read; num_speculative_tokens is required and 1 + N tokens are queried per "
                   "step, so N = block_size - 1 must be set by hand",
                   "config/speculative.py:821-825; v1/spec_decode/dflash.py:109; "
                   "v1/worker/gpu/spec_decode/dflash/speculator.py:43"),
    "target_window": ("a target whose layers share one sliding_window (no layer_types, or all of one type) has it "
                      "set as CacheConfig.sliding_window, and every attention layer built without a window of its "
                      "own takes that one: the drafter's layers too",
                      "engine/arg_utils.py:1825-1830; model_executor/layers/attention/attention.py:229-236; "
                      "transformers_utils/config.py:568-575"),
    "gguf_quantization_config": ("a target config.json whose quantization_config has quant_method gguf sends the "
                                 "model down the GGUF loader", "config/model.py:976-1041"),
    "cudagraph_ceiling": ("CUDA graphs are captured up to max_cudagraph_capture_size tokens a step, by default "
                          "min(max_num_seqs * (1 + num_speculative_tokens) * 2, 512); a step above it runs eagerly. "
                          "A decode step of c requests queries c * (1 + k) tokens, so at k = 15 every step of more "
                          "than 32 requests runs without graphs (measured on the H200: inter-token latency 14 ms "
                          "instead of 3 at 64 requests)",
                          "config/vllm.py:1683-1694, 1675-1676 (docstring); engine/arg_utils.py:1464-1467 "
                          "(--max-cudagraph-capture-size)"),
}
_AS_024 = " (0.24's lines: the 0.26 notes list no change)"
VLLM_026_RULES: dict[str, tuple[str, str]] = {
    "last_layer_tap": (VLLM_024_RULES["last_layer_tap"][0],
                       "model_executor/models/llama.py:419-428,435; qwen2.py:415-422,429; "
                       "models/interfaces.py:1349-1359"),
    "sliding_window": ("layer_types / sliding_window are read per layer: a sliding_attention layer is causal with a "
                       "window of sliding_window keys, its own included, a full one non-causal: served as trained",
                       "model_executor/models/qwen3_dflash.py:55-132, 278-289; "
                       "v1/attention/backends/flash_attn.py:308-319, 654-659"),
    "mixed_layers": ("a drafter mixing sliding and full layers needs several KV groups: it forces the V2 model "
                     "runner, and the V1 runner refuses it",
                     "config/vllm.py:565-568, 593-603; model_executor/models/qwen3_dflash.py:101-112"),
    "schedule_runner": ("a per-batch-size schedule runs on the V2 model runner (the default for dense models; "
                        "dynamic k is no longer on V2's unsupported list), one decode CUDA graph per k",
                        "config/vllm.py:605-622, 2127-2214; v1/worker/gpu/cudagraph_utils.py:196-214"),
    "zero_k_range": ("a schedule's k = 0 range still runs the drafter's query pass: the drafter drafts N and the "
                     "scheduler keeps the first k", "v1/core/sched/scheduler.py:625-634, 1132-1137; "
                     "v1/worker/gpu/spec_decode/dflash/speculator.py:45"),
    "dspark": ("DSpark is served (method dspark, from 0.25), on the V2 model runner only",
               "config/speculative.py:62, 75, 882-887; config/vllm.py:555-563"),
    "block_size": (VLLM_024_RULES["block_size"][0], "config/speculative.py:990-994; v1/spec_decode/dflash.py:115; "
                   "v1/worker/gpu/spec_decode/dflash/speculator.py:45"),
    "target_window": (VLLM_024_RULES["target_window"][0], VLLM_024_RULES["target_window"][1] + _AS_024),
    "gguf_quantization_config": (VLLM_024_RULES["gguf_quantization_config"][0], "config/model.py:1034-1110"),
    "cudagraph_ceiling": (VLLM_024_RULES["cudagraph_ceiling"][0], VLLM_024_RULES["cudagraph_ceiling"][1] + _AS_024),
}
VLLM_RULES = {"0.24": VLLM_024_RULES, "0.26": VLLM_026_RULES}  # the release whose rules a version follows
VLLM_DEFAULT_CUDAGRAPH_CEILING = 512  # tokens a step: vLLM's largest default capture size (0.24, 0.26)
VLLM_VERSION = "0.26"  # the release the project serves with: the rules when no vLLM is installed
ENGINE_CHOICES = ("all", "vllm")  # `dflashkit export --for`: every engine, or the installed vLLM only


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM itself is not imported), or None."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_release(version: str | None = None) -> str:
    """The release of ``VLLM_RULES`` that vLLM ``version`` follows: "0.24" before 0.26, "0.26" from it on (later
    releases need another torch and are not checked here). None, or a version that names no release (the CPU
    stand-in's "stand-in"): the installed vLLM's, else ``VLLM_VERSION``."""
    found = re.match(r"\s*(\d+)\.(\d+)", version or "") or re.match(r"(\d+)\.(\d+)", installed_vllm_version() or "")
    if not found:
        return VLLM_VERSION
    return "0.24" if (int(found[1]), int(found[2])) < (0, 26) else "0.26"


def vllm_rule(name: str, version: str | None = None) -> tuple[str, str]:
    """(what vLLM ``version`` does, where) for one rule."""
    return VLLM_RULES[vllm_release(version)][name]


def serves_sliding_window(version: str | None = None) -> bool:
    """Whether vLLM ``version`` serves sliding_attention drafter layers as trained (rule "sliding_window")."""
    return vllm_release(version) != "0.24"


def schedule_runner(version: str | None = None) -> str:
    """The model runner ("v1" or "v2") vLLM ``version`` serves a per-batch-size schedule on (rule
    "schedule_runner")."""
    return "v1" if vllm_release(version) == "0.24" else "v2"


def is_mixed_layers(layer_types) -> bool:
    """True for a drafter with both sliding and full attention layers (rule "mixed_layers")."""
    return len(set(layer_types)) > 1


def last_layer_tap_reason(target_layer_ids, num_target_layers: int, version: str | None = None) -> str | None:
    """Why vLLM would feed this drafter a different feature than it trained on (id L-1), or None."""
    last = int(num_target_layers) - 1
    if last not in [int(i) for i in target_layer_ids]:
        return None
    return (f"target_layer_ids {list(target_layer_ids)} include {last}, the target's last layer: vLLM "
            f"{vllm_release(version)} captures it before the final norm while training read it after "
            f"({vllm_rule('last_layer_tap', version)[1]}); train with ids below {last} (the default ids stop at "
            f"L-3)")


def sliding_window_reason(layer_types, version: str | None = None) -> str | None:
    """Why vLLM ``version`` serves this drafter differently from its training (sliding-window layers on 0.24), or
    None (no sliding layer, or a release that serves them as trained)."""
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if not sliding or serves_sliding_window(version):
        return None
    return (f"drafter layers {sliding} are sliding_attention: vLLM {vllm_release(version)} ignores layer_types and "
            f"sliding_window and serves them as full attention ({vllm_rule('sliding_window', version)[1]}), so "
            f"acceptance there is lower than trained; serve with vLLM 0.26 or later, or train with full_attention "
            f"layers")


def target_window_reason(target_config: dict, max_model_len: int | None = None,
                         version: str | None = None) -> str | None:
    """Why vLLM ``version`` would serve a drafter of this target (its config.json) with windowed attention it was not
    trained with, or None: the target's one sliding window reaches the drafter's layers (rule "target_window");
    nothing when the window covers ``max_model_len``."""
    text = target_config.get("text_config") or target_config
    window = text.get("sliding_window")
    if text.get("use_sliding_window") is False:  # Qwen2 / Qwen3 configs: transformers drops the window
        window = None
    types = text.get("layer_types") or []
    if not window or len(set(types)) > 1 or (max_model_len is not None and int(window) >= int(max_model_len)):
        return None
    return (f"the target's sliding_window {window} is one for every layer, and vLLM {vllm_release(version)} gives it "
            f"to the drafter's layers too ({vllm_rule('target_window', version)[1]}): beyond {window} tokens of "
            f"context the drafter attends to fewer keys than in training and acceptance drops; serve with "
            f"max_model_len <= {window} to stay within what it was trained on")


def vllm_warnings(config, version: str | None = None) -> list[str]:
    """What vLLM ``version`` (default: the installed one, ``vllm_release``) would serve differently from
    training, for a DrafterConfig (empty when nothing)."""
    reasons = [last_layer_tap_reason(config.target_layer_ids, config.num_target_layers, version),
               sliding_window_reason(config.layer_types, version)]
    return [r for r in reasons if r]


def check_export_for(config, engine: str = "all", warn=print, version: str | None = None) -> None:
    """Act on the rules of vLLM ``version`` (default: the installed one, ``vllm_release``) at export: for
    ``engine="vllm"`` a rule that it breaks is a UserError; for every engine ("all") it is a warning passed to
    ``warn``."""
    if engine not in ENGINE_CHOICES:
        raise UserError(f"--for {engine!r}: choose one of {', '.join(ENGINE_CHOICES)}")
    for reason in vllm_warnings(config, version):
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


def vllm_cudagraph_capture_size(max_num_seqs: int, num_speculative_tokens: int) -> int | None:
    """The max_cudagraph_capture_size that keeps a decode step of ``max_num_seqs`` requests, each querying
    1 + ``num_speculative_tokens`` tokens, inside CUDA graphs (rule "cudagraph_ceiling"), rounded up to vLLM's
    step of 16; None when vLLM's default already covers it."""
    tokens = int(max_num_seqs) * (1 + int(num_speculative_tokens))
    if tokens <= VLLM_DEFAULT_CUDAGRAPH_CEILING:  # the default is min(2 * tokens, 512) >= tokens
        return None
    return -(-tokens // 16) * 16


def vllm_serve_command(target: str, drafter: str, block_size: int, speculative_config: dict | None = None,
                       max_num_seqs: int | None = None, cudagraph_capture_size: int | None = None,
                       engine_flags: list[str] | None = None, speculate: bool = True) -> str:
    """The `vllm serve` line for a drafter: num_speculative_tokens = block_size - 1 (vLLM reads no block_size),
    or the given speculative_config (a per-batch-size schedule's); ``max_num_seqs`` and
    ``cudagraph_capture_size`` (``vllm_cudagraph_capture_size``: what covers those requests' decode steps) as
    the engine was measured with, then ``engine_flags`` as they are; without ``speculate`` no speculative_config
    at all. Every word is quoted for a POSIX shell where it needs to be. A DFlash2 export is checked against vLLM
    0.28 first (``dflash2_serve_note``: no schedule, N = block_size - 1) and the line names the vLLM that serves
    it."""
    import shlex

    spec = speculative_config or {"method": "dflash", "model": str(drafter),
                                  "num_speculative_tokens": int(block_size) - 1}
    from .vllm_dflash2 import dflash2_serve_note  # DFlash2 exports: vLLM 0.28's rules

    note = dflash2_serve_note(drafter, spec) if speculate and spec.get("method") == "dflash" else ""
    words = ["vllm", "serve", str(target)] + (["--max-num-seqs", str(int(max_num_seqs))] if max_num_seqs else []) + (
        ["--max-cudagraph-capture-size", str(int(cudagraph_capture_size))] if cudagraph_capture_size else [])
    words += list(engine_flags or []) + (["--speculative-config", json.dumps(spec)] if speculate else [])
    return " ".join(shlex.quote(w) for w in words) + note


def is_gguf_quantized(config: dict) -> bool:
    """True when a target config.json carries the GGUF quantization_config that save_pretrained leaves."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "gguf"


def vllm_target_dir(target_dir, scratch) -> tuple[Path, bool]:
    """(directory to give vLLM, whether it is a stripped copy). A target whose config.json has a GGUF
    quantization_config is served from a copy under ``scratch``: every other file symlinked, config.json
    rewritten without that key (the weights there are already plain tensors). A copy already there is made
    again, so it never keeps the links of another target of the same name."""
    source = Path(target_dir)
    config = json.loads((source / "config.json").read_text())
    if not is_gguf_quantized(config):
        return source, False
    copy = Path(scratch) / f"{source.name}-without-gguf-config"
    copy.mkdir(parents=True, exist_ok=True)
    for item in copy.iterdir():  # an earlier copy (a kept report directory) may link another target's files
        if item.is_symlink() or item.name == "config.json":
            item.unlink()
    for item in source.iterdir():
        if item.name != "config.json":
            (copy / item.name).symlink_to(item.resolve())
    del config["quantization_config"]
    atomic_write(copy / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return copy, True
