"""Save and load drafters in the format vLLM (`method: dflash`), SGLang (`DFLASH`) and the reference load.

An export directory holds:
- ``model.safetensors``: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``; nothing of the target.
- ``config.json``: Qwen3 fields + DFlash fields (see DrafterConfig.to_json_dict; only fields vLLM and SGLang read
  alike, engines.py), ``dtype`` = the weights' dtype, ``auto_map`` -> the shipped ``modeling_dflash.py``, so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` works without dflashkit (``spec_generate`` included).

Loading is strict: every tensor the config implies must be present with the shape it implies, and nothing else;
a mismatch names the tensor, both shapes and the config field to check. Only safetensors are read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DrafterConfig
from .modeling_dflash import DFlashDraftModel

MODELING_FILE = Path(__file__).with_name("modeling_dflash.py")
# Which config field fixes each tensor's shape: named in load errors.
SHAPE_FIELDS = {
    "fc.weight": "hidden_size / target_layer_ids", "q_proj": "num_attention_heads / head_dim",
    "k_proj": "num_key_value_heads / head_dim", "v_proj": "num_key_value_heads / head_dim",
    "o_proj": "num_attention_heads / head_dim", "q_norm": "head_dim", "k_norm": "head_dim",
    "gate_proj": "intermediate_size", "up_proj": "intermediate_size", "down_proj": "intermediate_size",
}


def build_drafter(config: DrafterConfig, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A randomly initialised drafter for ``config``."""
    model = DFlashDraftModel(config.resolved().to_hf()).to(dtype)
    model.dflash = config.resolved()
    return model


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write the export directory atomically (a temporary sibling renamed into place)."""
    config: DrafterConfig = getattr(model, "dflash", None) or DrafterConfig.from_json_dict(model.config.to_dict())
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        state = {k: (v.to(dtype) if dtype else v).detach().to("cpu").contiguous()
                 for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = config.to_json_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(state["fc.weight"].dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copyfile(MODELING_FILE, tmp / "modeling_dflash.py")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json; a drafter directory needs config.json and "
                                f"model.safetensors (write one with `dflashkit init-drafter` or `dflashkit export`)")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON (line {e.lineno}: {e.msg})") from None
    return DrafterConfig.from_json_dict(data, source=str(cfg_file))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bad = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {bad}: pickle files are never loaded; convert them to safetensors)" if bad else ""
        raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
    return files


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load an export (ours or a published reference-format drafter); strict on names and shapes."""
    path = Path(path)
    config = read_drafter_config(path)
    model = build_drafter(config, dtype=dtype)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    loaded: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = key[len("model."):] if key.startswith("model.") and key[6:] in expected else key
                loaded[name] = sf.get_tensor(key)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json: missing {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                         f"{' ...' if len(unexpected) > 6 else ''}; check num_hidden_layers and the tensor names")
    for name, ref in expected.items():
        if tuple(loaded[name].shape) != tuple(ref.shape):
            field = next((v for k, v in SHAPE_FIELDS.items() if k in name), "hidden_size")
            raise ValueError(f"{path}: tensor {name} has shape {tuple(loaded[name].shape)} but config.json implies "
                             f"{tuple(ref.shape)}; check the config field(s) {field}")
    model.load_state_dict({k: v.to(dtype) for k, v in loaded.items()}, strict=False)
    return model.to(device).eval()
