"""Save and load drafters in the format vLLM (`method: dflash`), SGLang (`DFLASH`) and the reference load.

An export directory holds:
- ``model.safetensors``: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``; nothing of the target.
- ``config.json``: Qwen3 fields + DFlash fields (see DrafterConfig.to_json_dict; only fields vLLM and SGLang read
  alike, serving_rules.py), ``dtype`` = the weights' dtype, ``auto_map`` -> the shipped ``modeling_dflash.py``, so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` works without dflashkit (``spec_generate`` included);
  from a training run also ``chat_template`` (the Jinja text it rendered with; null: the target tokenizer's
  own) and ``chat_template_kwargs``, which eval renders its prompts with (eval/chat_settings.py).

An existing directory at the export path is replaced only when it is a drafter export (``export_dir_problem``),
``overwrite`` or not; a file there is an error (``dflashkit/outputs.py``). The files get the
umask's usual modes (0644 / 0755), so a server running as another user can read them. Weights with NaN or Inf
are never written.

Writing is two renames: the new export is written to ``.NAME.XXXXXXXX``, the old one moved to
``.NAME.old-XXXXXXXX/NAME``, the new one renamed to NAME (sibling names shortened with a hash to fit the file
system's limit). A running export holds an flock on its temporary directories; a killed one leaves them
unheld, and the next export to NAME moves a moved-aside export back to a missing NAME, removes the rest and says
so, while loading a missing NAME whose previous export was moved aside says where it is.

Loading is strict: the weights are ``model.safetensors`` or the files ``model.safetensors.index.json`` names
(any other ``*.safetensors`` is ignored, with a note), each tensor stored once, a float, finite; every tensor
the config implies must be present with the shape it implies, and nothing else; a mismatch names the tensor,
both shapes and the config field to check. config.json's fields are checked by type (``DrafterConfig
.from_json_dict``). Only safetensors are read; a damaged file is one line naming it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflashkit.errors import UserError
from dflashkit.files import (
    check_name_length,
    disk_full_errno,
    disk_full_error,
    fitted_name,
    name_limit,
    pause_point,
    rename_dir_into_place,
    swap_dir_into_place,
)
from dflashkit.outputs import check_output_dir, describe_foreign, foreign_entries, make_temp_dir, save_safetensors
from dflashkit.untrusted import contained_file

from .config import DrafterConfig
from .kinds import KINDS, kind_for
from .modeling_dflash import DFlashDraftModel

MODELING_DIR = Path(__file__).parent  # where the modeling files an export ships lie (drafter/kinds/ names them)
# Which config field fixes each tensor's shape: named in load errors.
SHAPE_FIELDS = {
    "fc.weight": "hidden_size / target_layer_ids", "q_proj": "num_attention_heads / head_dim",
    "k_proj": "num_key_value_heads / head_dim", "v_proj": "num_key_value_heads / head_dim",
    "o_proj": "num_attention_heads / head_dim", "q_norm": "head_dim", "k_norm": "head_dim",
    "gate_proj": "intermediate_size", "up_proj": "intermediate_size", "down_proj": "intermediate_size",
}
# what save_drafter writes: the weights, config.json and the modeling files of the drafter's kind (drafter/kinds/)
EXPORT_FILES = ("config.json", "model.safetensors",
                *dict.fromkeys(name for kind in KINDS.values() for name in kind.modeling_files))
DRAFTER_ARCHITECTURES = tuple(kind.class_name for kind in KINDS.values())


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
    """A randomly initialised drafter for ``config``: the model class of its kind (drafter/kinds/)."""
    model = kind_for(config.architecture).model_class(config.resolved().to_hf()).to(dtype)
    model.dflash = config.resolved()
    return model


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 overwrite: bool = False, flag: str = "--overwrite", chat: dict | None = None,
                 metadata: dict[str, str] | None = None) -> Path:
    """Write the export directory atomically (a temporary sibling renamed into place). An existing directory is
    replaced only when it is an export, ``overwrite`` or not; ``flag`` is the option named in the refusal.
    ``metadata``: strings recorded in model.safetensors' metadata (what the export was made from). What an
    interrupted export to the same path left is recovered or removed first (``recover_interrupted_export``);
    weights that are not finite are refused before anything is written. ``chat``: the chat settings training
    rendered its data with (``chat_template``: the text, None for the target tokenizer's own;
    ``chat_template_kwargs``), written into config.json, where eval reads them (eval/chat_settings.py)."""
    config: DrafterConfig = getattr(model, "dflash", None) or DrafterConfig.from_json_dict(model.config.to_dict())
    out = Path(out_dir)
    state = {k: (v.to(dtype) if dtype else v).detach().to("cpu").contiguous()
             for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    check_finite(state, f"the drafter to export to {out}", dtype)
    check_name_length(out)
    if out.parent.is_dir():
        recover_interrupted_export(out)
    check_output_dir(out, what="a drafter directory", problem=export_dir_problem, overwrite=overwrite, flag=flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, prefix=f".{_sibling_stem(out)}.")
    held = _hold(tmp)  # while held, another export's recovery leaves this directory alone
    try:
        _write_export(tmp, state, config, chat or {}, metadata)
        pause_point("export-copy-written")  # crash tests: a kill here leaves the full copy
        old = make_temp_dir(out.parent, f".{_sibling_stem(out)}.old-")  # a fresh name: nothing of the user's
        held_old = _hold(old)
        try:  # an export or an empty directory at NAME (checked above) goes to .NAME.old-*/NAME first
            swap_dir_into_place(tmp, out, old, pause_name="export-between-renames")  # crash tests: no NAME then
        finally:
            os.close(held_old)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        code = disk_full_errno(error)
        if code is not None:  # the environment's: one line; an existing export at ``out`` was not touched
            raise disk_full_error(code, out, sum(t.nbytes for t in state.values())) from error
        raise
    finally:
        os.close(held)
    return out


def _write_export(directory: Path, state: dict[str, torch.Tensor], config: DrafterConfig, chat: dict,
                  metadata: dict[str, str] | None = None) -> None:
    """The export's files in ``directory`` (made durable by the caller's rename into place, dflashkit/files.py)."""
    save_safetensors(state, directory / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    cfg = config.to_json_dict()
    cfg["torch_dtype"] = cfg["dtype"] = str(state["fc.weight"].dtype).replace("torch.", "")
    cfg.update({k: chat[k] for k in ("chat_template", "chat_template_kwargs") if k in chat})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in kind_for(config.architecture).modeling_files:  # what config.json's auto_map loads
        shutil.copyfile(MODELING_DIR / name, directory / name)


def check_finite(state: dict[str, torch.Tensor], what: str, dtype: torch.dtype | None = None) -> None:
    """UserError naming the first tensor of ``state`` that holds NaN or Inf (``what`` says whose tensors)."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(_checkable(tensor)).all()):
            cast = (f" once cast to {str(dtype).replace('torch.', '')} (a wider --dtype may hold them)"
                    if dtype is not None else "")
            raise UserError(f"{what}: tensor {name} holds NaN or Inf values{cast}; the training that wrote it "
                            f"diverged: use a checkpoint from before the divergence")


def _checkable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.element_size() == 1 else tensor  # isfinite has no 8-bit float kernels


# ----------------------------------------------------------------------------- interrupted exports
# save_drafter's temporary names beside NAME: ``.NAME.XXXXXXXX`` (the new export being written) and
# ``.NAME.old-XXXXXXXX/NAME`` (the previous export, between the two renames); XXXXXXXX: make_temp_dir's 4 random
# bytes. NAME is shortened (``fitted_name``) so that the longer of the two fits the file system's name limit.
_OLD_PREFIX = "old-"
_RANDOM_PART = "[0-9a-f]{8}"


def _sibling_stem(out: Path) -> str:
    return fitted_name(out.name, len(f"..{_OLD_PREFIX}") + 8, name_limit(out.parent))


def _hold(directory: Path) -> int:
    """An exclusive flock on ``directory``, held until the returned descriptor is closed (the kernel drops it when
    the process dies, so a killed export's directories are free)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # no flock there: nothing is held
            os.close(fd)
            raise
    return fd


def _held_by_another(directory: Path) -> bool:
    """Whether a running export holds ``directory`` (``_hold``)."""
    try:
        fd = _hold(directory)
    except OSError:
        return True
    os.close(fd)
    return False


def interrupted_export_leftovers(out: Path) -> tuple[list[Path], list[Path]]:
    """What interrupted exports to ``out`` left beside it and no running export holds: temporary copies whose
    files are all export files, and directories holding nothing but a moved-aside previous export ``NAME``
    (newest first)."""
    stem = re.escape(_sibling_stem(out))
    copy_name = re.compile(rf"\.{stem}\.{_RANDOM_PART}")
    old_name = re.compile(rf"\.{stem}\.{_OLD_PREFIX}{_RANDOM_PART}")
    copies, olds = [], []
    for entry in out.parent.iterdir() if out.parent.is_dir() else ():
        if entry.is_symlink() or not entry.is_dir():
            continue
        if copy_name.fullmatch(entry.name) and not foreign_entries(entry, lambda name: name in EXPORT_FILES):
            copies.append(entry)
        elif old_name.fullmatch(entry.name) and not foreign_entries(entry, lambda name: name == out.name):
            olds.append(entry)
    olds.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    return ([p for p in sorted(copies) if not _held_by_another(p)],
            [p for p in olds if not _held_by_another(p)])


def recover_interrupted_export(out: Path) -> None:
    """Undo what an export to ``out`` killed midway left, and say so on stderr: a previous export moved aside
    while ``out`` is missing goes back to ``out`` (this export then replaces it as usual); a moved-aside export
    that ``out`` already replaced and any temporary copy are removed."""
    copies, olds = interrupted_export_leftovers(out)
    restored, removed = None, [p.name for p in copies + olds]
    for old in olds:
        if (old / out.name).is_dir() and not os.path.lexists(out):
            rename_dir_into_place(old / out.name, out)
            restored = old
    for leftover in copies + olds:
        shutil.rmtree(leftover)
    if restored is not None:
        print(f"note: {out}: moved back from {restored.name}, where an interrupted export had left it",
              file=sys.stderr)
    if removed:
        print(f"note: {out.parent}: removed {removed}, left by an interrupted export to {out.name}", file=sys.stderr)


def _moved_aside(path: Path) -> Path | None:
    """The previous export that an interrupted export moved from the missing ``path`` (``.NAME.old-*/NAME``)."""
    if os.path.lexists(path) or not path.parent.is_dir():
        return None
    olds = interrupted_export_leftovers(path)[1]
    return next((old / path.name for old in olds if (old / path.name).is_dir()), None)


# ----------------------------------------------------------------------------- loading
def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    cfg_file = Path(path) / "config.json"
    moved = _moved_aside(Path(path))
    if moved is not None:
        raise UserError(f"{path} is missing: an export to it was interrupted after moving the previous export to "
                        f"{moved}; move that back to {path}, or run dflashkit export to {path} again")
    if not cfg_file.is_file() and (Path(path) / "checkpoint.json").is_file():
        raise UserError(f"{path} is a training checkpoint, not a drafter directory: export it first "
                        f"(`dflashkit export {path} DIR`) and give DIR")
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file}: no config.json; a drafter directory needs config.json and "
                        f"model.safetensors (write one with `dflashkit init-drafter` or `dflashkit export`)")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_file}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{cfg_file}: not text (not UTF-8); the file is damaged: restore it or export the "
                        f"drafter again") from None
    return DrafterConfig.from_json_dict(data, source=str(cfg_file))


def _weight_files(path: Path) -> list[Path]:
    """The files a drafter's weights come from: those ``model.safetensors.index.json`` names, else
    ``model.safetensors``; any other ``*.safetensors`` there is never read (a note names it)."""
    index = path / "model.safetensors.index.json"
    files = _indexed_files(path, index) if index.is_file() else [path / "model.safetensors"]
    if not files[0].is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        other = sorted(p.name for p in path.glob("*.safetensors"))
        hint = (f" (found {pickles}: pickle files are never loaded; convert them to safetensors)" if pickles else
                f" (found {other}, which is not read: rename the file that holds the weights to "
                f"model.safetensors)" if other else "")
        raise UserError(f"{path}: no model.safetensors weights{hint}")
    stray = sorted(p.name for p in path.glob("*.safetensors") if p not in files)
    if stray:
        print(f"note: {path}: ignored {stray}: a drafter's weights are model.safetensors or the files "
              f"model.safetensors.index.json names", file=sys.stderr)
    return files


def _indexed_files(path: Path, index: Path) -> list[Path]:
    """The files ``index``'s weight_map names, each inside the drafter directory (dflashkit/untrusted.py)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{index}: not valid JSON ({e}); the file is damaged: restore it, or remove it to "
                        "read model.safetensors") from None
    except AttributeError:  # valid JSON, but not an object
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: field weight_map is missing or not a mapping of tensor name -> file; the "
                        "file is damaged: restore it, or remove it to read model.safetensors")
    files = sorted({contained_file(path, f, source=index, field=f"weight_map[{name!r}]")
                    for name, f in weight_map.items()})
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{index} names {missing[0].name}, which is not in {path}; the download is "
                        "incomplete: fetch the missing weight file")
    return files


def _file_tensors(f: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``f``; one line naming the file when it is damaged or cut short."""
    try:
        with safe_open(str(f), framework="pt") as sf:
            return {key: sf.get_tensor(key) for key in sf.keys()}
    except SafetensorError as e:
        reason = (str(e).splitlines() or ["unreadable"])[0]
        raise UserError(f"{f}: not a readable safetensors file ({reason}); it is damaged or cut short: export "
                        f"the drafter again (or download it again)") from None


def _read_weights(path: Path, expected: set[str]) -> dict[str, torch.Tensor]:
    """The drafter's tensors by name (``model.`` prefixes dropped), each stored once, float and finite."""
    loaded: dict[str, torch.Tensor] = {}
    stored_in: dict[str, Path] = {}
    for f in _weight_files(path):
        tensors = _file_tensors(f)
        for key, tensor in tensors.items():
            name = key[len("model."):] if key.startswith("model.") and key[6:] in expected else key
            if name in loaded:
                raise UserError(f"{path}: tensor {name} is stored twice ({stored_in[name].name} and {f.name}), so "
                                f"which one is meant is unknown; keep it in one file")
            if not tensor.is_floating_point():
                raise UserError(f"{f}: tensor {key} is {str(tensor.dtype).replace('torch.', '')}; drafter "
                                f"weights are floats (bfloat16, float16, float32): export the drafter again")
            loaded[name], stored_in[name] = tensor, f
        check_finite(tensors, str(f))
    return loaded


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load an export (ours or a published reference-format drafter); strict on names, shapes, dtypes and
    values: every weight a finite float, each stored once."""
    path = Path(path)
    config = read_drafter_config(path)
    model = build_drafter(config, dtype=dtype)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    loaded = _read_weights(path, set(expected))
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match config.json: missing {missing[:6]}"
                        f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                        f"{' ...' if len(unexpected) > 6 else ''}; check num_hidden_layers and the tensor names")
    for name, ref in expected.items():
        if tuple(loaded[name].shape) != tuple(ref.shape):
            field = next((v for k, v in SHAPE_FIELDS.items() if k in name), "hidden_size")
            raise UserError(f"{path}: tensor {name} has shape {tuple(loaded[name].shape)} but config.json implies "
                            f"{tuple(ref.shape)}; check the config field(s) {field}")
    model.load_state_dict({k: v.to(dtype) for k, v in loaded.items()}, strict=False)
    return model.to(device).eval()
