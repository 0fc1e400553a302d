"""Save and load drafters in the format vLLM (`method: dflash`), SGLang (`DFLASH`) and the reference load.

An export directory holds:
- ``model.safetensors``: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``; nothing of the target.
- ``config.json``: Qwen3 fields + DFlash fields (see DrafterConfig.to_json_dict; only fields vLLM and SGLang read
  alike, engines.py), ``dtype`` = the weights' dtype, ``auto_map`` -> the shipped ``modeling_dflash.py``, so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` works without dflashkit (``spec_generate`` included).

An existing directory at the export path is replaced only when it is a drafter export (``export_dir_problem``)
or the caller passes ``overwrite``; a file there is an error (``dflashkit/outputs.py``). The files get the
umask's usual modes (0644 / 0755), so a server running as another user can read them.

Loading is strict: every tensor the config implies must be present with the shape it implies, and nothing else;
a mismatch names the tensor, both shapes and the config field to check. Only safetensors are read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from dflashkit.outputs import check_output_dir, describe_foreign, foreign_entries, make_temp_dir, save_safetensors
from dflashkit.untrusted import contained_file

from .config import DrafterConfig
from .modeling_dflash import DFlashDraftModel
from .modeling_dflash2 import DFlash2DraftModel

MODELING_FILE = Path(__file__).with_name("modeling_dflash.py")
MODELING_FILE_DFLASH2 = Path(__file__).with_name("modeling_dflash2.py")  # imports modeling_dflash.py: both ship
# Which config field fixes each tensor's shape: named in load errors.
SHAPE_FIELDS = {
    "fc.weight": "hidden_size / target_layer_ids", "q_proj": "num_attention_heads / head_dim",
    "k_proj": "num_key_value_heads / head_dim", "v_proj": "num_key_value_heads / head_dim",
    "o_proj": "num_attention_heads / head_dim", "q_norm": "head_dim", "k_norm": "head_dim",
    "gate_proj": "intermediate_size", "up_proj": "intermediate_size", "down_proj": "intermediate_size",
}
# what save_drafter writes (modeling_dflash2.py for a DFlash2 drafter only)
EXPORT_FILES = ("config.json", "model.safetensors", "modeling_dflash.py", "modeling_dflash2.py")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def export_dir_problem(path: Path) -> str | None:
    """Why the existing directory ``path`` is not a drafter export that ``save_drafter`` may replace; None when
    it is one: config.json naming a DFlash architecture, model.safetensors, and no other files."""
    foreign = foreign_entries(path, lambda name: name in EXPORT_FILES)
    if foreign:
        return describe_foreign(foreign)
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "no readable config.json"
    if not set(architectures) & set(DRAFTER_ARCHITECTURES) or not (path / "model.safetensors").is_file():
        return f"config.json architectures {architectures} and model.safetensors do not make a DFlash drafter"
    return None


def build_drafter(config: DrafterConfig, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A randomly initialised drafter for ``config`` (DFlash2DraftModel when ``architecture`` is dflash2)."""
    cls = DFlash2DraftModel if config.architecture == "dflash2" else DFlashDraftModel
    model = cls(config.resolved().to_hf()).to(dtype)
    model.dflash = config.resolved()
    return model


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 overwrite: bool = False, flag: str = "--overwrite") -> Path:
    """Write the export directory atomically (a temporary sibling renamed into place). An existing directory is
    replaced only when it is an export (or ``overwrite``); ``flag`` is the option named in the refusal."""
    config: DrafterConfig = getattr(model, "dflash", None) or DrafterConfig.from_json_dict(model.config.to_dict())
    out = Path(out_dir)
    check_output_dir(out, what="a drafter directory", problem=export_dir_problem, overwrite=overwrite, flag=flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, prefix=f".{out.name}.")
    try:
        state = {k: (v.to(dtype) if dtype else v).detach().to("cpu").contiguous()
                 for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = config.to_json_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(state["fc.weight"].dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copyfile(MODELING_FILE, tmp / "modeling_dflash.py")
        if config.architecture == "dflash2":
            shutil.copyfile(MODELING_FILE_DFLASH2, tmp / "modeling_dflash2.py")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.is_dir():  # checked above: an export, an empty directory, or overwrite
            old = make_temp_dir(out.parent, f".{out.name}.old-")  # a fresh name: nothing of the user's is touched
            out.rename(old / out.name)
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
    if index.is_file():  # each file it names must lie inside the drafter directory (dflashkit/untrusted.py)
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not valid JSON ({e}); the file is damaged: restore it, or remove it to "
                             "read the *.safetensors files of the directory") from None
        except AttributeError:  # valid JSON, but not an object
            weight_map = None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: field weight_map is missing or not a mapping of tensor name -> file; the "
                             "file is damaged: restore it, or remove it to read the *.safetensors files")
        files = sorted({contained_file(path, f, source=index, field=f"weight_map[{name!r}]")
                        for name, f in weight_map.items()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing[0].name}, which is not in {path}; the download is "
                                    "incomplete: fetch the missing weight file")
        return files
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
