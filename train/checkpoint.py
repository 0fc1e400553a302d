"""Training checkpoints: written whole or not at all, safetensors + JSON only, the same layout for every backend.

A checkpoint ``<output_dir>/checkpoints/step-00001200/`` holds:
- ``model.safetensors``: the drafter's fp32 master weights, full (unsharded) tensors under their module names;
- ``optimizer.safetensors``: AdamW state per parameter (``state.<name>.exp_avg``, ``.exp_avg_sq``, ``.step``);
- ``trainer.json``: step, epoch, samples of the epoch consumed, the TrainConfig, the DrafterConfig, the
  optimizer's hyper-parameters, world size, the data's fingerprint (train/data_fingerprint.py);
- ``rng-rank<r>.safetensors`` + ``rng-rank<r>.json``: every rank's torch / CUDA / Python / NumPy RNG state;
- ``checkpoint.json`` (written last): byte size and sha256 of every file above.

Design choices:
- Nothing of the target is saved (its embedding, norm and lm_head are frozen inputs, re-read at start).
- No pickle: optimizer state is flattened into safetensors, everything else is JSON. Model and optimizer
  states are gathered to full tensors (``torch.distributed.checkpoint.state_dict`` for plain / DDP / FSDP
  models, DeepSpeed's tensor-fragment API for ZeRO; train/full_state.py), so a checkpoint resumes under any backend and
  world size.
- Atomicity: files go to ``.tmp-step-XXXXXXXX/``, ``checkpoint.json`` last, then the directory is fsynced whole
  and renamed into place (dflashkit/files.py: a directory's shape of its one durability guarantee). A
  directory without a valid ``checkpoint.json``, or whose files do not match it, is never loaded;
  ``--resume auto`` skips it (with a warning naming it) and takes the newest complete one.
- keep-last-k deletes the oldest complete checkpoints after a new one is in place: only ones of an earlier step
  than the one just written, which is always kept (a later step's checkpoint is never this run's older one).
- A checkpoint altered after it was written (checkpoint.json, trainer.json's fields, the RNG files) is refused
  in one line naming the file and field (``check_trainer_state``), never a TypeError halfway through a resume.
- Preemption: ``dflashkit.stopping.StopRequest`` turns SIGTERM / SIGINT into a flag. The trainer reads it at
  the next step boundary (all ranks vote in the step's one collective, so they stop at the same step), writes a
  checkpoint at that step and returns; the command exits 0 saying how to resume. A second signal acts as it
  would without the handler (the checkpoint write is atomic either way).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from dflashkit.errors import UserError
from dflashkit.files import disk_full_errno, disk_full_error, pause_point, sha256_file, swap_dir_into_place
from dflashkit.outputs import save_safetensors

from .full_state import full_state, jsonable, load_full_state

STEP_DIR = re.compile(r"^step-(\d{8})$")
FORMAT = "dflashkit-train-checkpoint-v1"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


REQUIRED_FILES = ("model.safetensors", "optimizer.safetensors", "trainer.json")  # what every checkpoint lists


def verify_checkpoint(path: str | os.PathLike, hashes: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    meta_file = path / "checkpoint.json"
    if not meta_file.is_file():
        return "no checkpoint.json (the write did not finish)"
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"checkpoint.json is not valid JSON ({e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        return f"checkpoint.json format {found!r}, expected {FORMAT!r}"
    files = meta.get("files")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        return f"checkpoint.json field files does not list {list(REQUIRED_FILES)}"
    for name, info in files.items():
        # names are plain file names of this directory; each entry holds the file's size and sha256
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not isinstance(info, dict) \
                or not isinstance(info.get("bytes"), int) or not isinstance(info.get("sha256"), str):
            return f"checkpoint.json field files[{name!r}] is not {{bytes: int, sha256: str}} for a file here"
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, checkpoint.json says {info['bytes']}"
        if hashes and sha256_file(f) != info["sha256"]:
            return f"{name} does not match its sha256 in checkpoint.json (corrupted)"
    return None


def checkpoint_step(path: Path) -> int:
    """The step of a step directory's name (``step-00001200`` -> 1200)."""
    return int(STEP_DIR.match(path.name).group(1))


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Step directories under output_dir/checkpoints, oldest first (complete or not)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=lambda p: p.name)


def latest_checkpoint(output_dir: str | os.PathLike, warn=print) -> Path | None:
    """The newest checkpoint that verifies; incomplete or corrupted ones are reported and skipped."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None


# --------------------------------------------------------------------------- RNG
def rng_state() -> tuple[dict, dict]:
    import numpy as np

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    info = {"python": jsonable(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, info


def set_rng_state(tensors: dict, info: dict) -> None:
    import numpy as np

    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    version, state, gauss = info["python"]
    random.setstate((version, tuple(state), gauss))
    n = info["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# --------------------------------------------------------------------------- save / load
def save_checkpoint(accelerator, model, optimizer, trainer_state: dict, output_dir: str | os.PathLike,
                    keep_last: int) -> Path:
    """Write step ``trainer_state['step']`` atomically; collective (every rank calls it)."""
    step = int(trainer_state["step"])
    root = checkpoints_root(output_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    weights, opt, opt_json = full_state(model, optimizer)
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    try:
        _write_checkpoint_files(accelerator, tmp, weights, opt, opt_json, trainer_state)
    except BaseException as error:  # a full disk: the partial copy goes, the space it took is given back
        shutil.rmtree(tmp, ignore_errors=True)
        code = disk_full_errno(error)
        if code is not None:
            needed = sum(t.nbytes for t in [*weights.values(), *opt.values()])
            raise disk_full_error(code, final, needed, then="run the same command again: it resumes from the last "
                                                             "checkpoint") from error
        raise
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())}
        meta = {"format": FORMAT, "step": step, "files": files}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=1))
        aside = root / f".old-step-{step:08d}"  # a re-run of the same step replaces the old copy, moved here
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir()
        swap_dir_into_place(tmp, final, aside)  # every file durable, then the renames (dflashkit/files.py)
        shutil.rmtree(aside)
        rotate_checkpoints(output_dir, step, keep_last)
        pause_point(f"checkpoint-{step}-saved")
    accelerator.wait_for_everyone()
    return final


def _write_checkpoint_files(accelerator, tmp: Path, weights: dict, opt: dict, opt_json: dict,
                            trainer_state: dict) -> None:
    """Every rank's RNG state; on the main process the weights, the optimizer state and the trainer state."""
    rank = accelerator.process_index
    rng_tensors, rng_info = rng_state()
    save_safetensors(rng_tensors, tmp / f"rng-rank{rank}.safetensors")
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_info))
    if accelerator.is_main_process:
        save_safetensors({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors",
                         metadata={"format": "pt"})
        save_safetensors({k: v.contiguous() for k, v in opt.items()}, tmp / "optimizer.safetensors")
        state = dict(trainer_state, optimizer=opt_json, world_size=accelerator.num_processes)
        (tmp / "trainer.json").write_text(json.dumps(jsonable(state), indent=1))


def rotate_checkpoints(output_dir: str | os.PathLike, step: int, keep_last: int) -> None:
    """Keep the checkpoint of ``step`` and the ``keep_last - 1`` newest complete ones before it; delete older ones.
    A checkpoint of a later step is never deleted: it is not an older one of this run (the run directory's
    checks refuse a run that would mix with one, train/run_dir.py), and rotation must not guess."""
    older = [p for p in list_checkpoints(output_dir)
             if checkpoint_step(p) < step and verify_checkpoint(p, hashes=False) is None]
    for old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: str | os.PathLike) -> dict:
    """trainer.json of a checkpoint; a file that is not a JSON object is refused naming it."""
    source = Path(path) / "trainer.json"
    try:
        state = json.loads(source.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{source}: not valid JSON ({e}); the checkpoint is damaged: use another checkpoint") from None
    if not isinstance(state, dict):
        raise UserError(f"{source}: a {type(state).__name__}, not a JSON object; the checkpoint is damaged: use "
                        f"another checkpoint")
    return state


# trainer.json fields a resume reads, and what each must be
RESUME_FIELDS = {"step": "a whole number >= 0", "epoch": "a whole number >= 0",
                 "epoch_samples_done": "a whole number >= 0", "drafter_config": "an object",
                 "optimizer": "an object with a list param_groups of objects"}


def _field_ok(name: str, value) -> bool:
    if name == "drafter_config":
        return isinstance(value, dict)
    if name == "optimizer":
        groups = value.get("param_groups") if isinstance(value, dict) else None
        return isinstance(groups, list) and bool(groups) and all(isinstance(g, dict) for g in groups)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_trainer_state(state: dict, path: str | os.PathLike, fields=tuple(RESUME_FIELDS)) -> dict:
    """``state`` (trainer.json of checkpoint ``path``) when its ``fields`` are what they must be, else one line
    naming the file and the field: a checkpoint edited by hand or by another tool is refused before it is used."""
    for name in fields:
        if name not in state or not _field_ok(name, state[name]):
            got = "missing" if name not in state else f"{state[name]!r}"[:60]
            raise UserError(f"{Path(path) / 'trainer.json'}: field {name} is {got}, expected {RESUME_FIELDS[name]}; "
                            f"the checkpoint was altered: use another checkpoint (or write it again by training)")
    return state


def read_weights(path: str | os.PathLike) -> dict:
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def nonfinite_tensor(weights: dict) -> str | None:
    """The name of the first tensor holding NaN or Inf, else None."""
    return next((name for name, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)


def load_checkpoint(path: str | os.PathLike, accelerator, model, optimizer, verified: bool = False) -> dict:
    """Restore weights, optimizer and this rank's RNG; returns trainer.json. Refuses incomplete checkpoints
    (``verified``: the caller has just verified it, train/run_dir.resume_point)."""
    path = Path(path)
    problem = None if verified else verify_checkpoint(path)
    if problem is not None:
        raise UserError(f"checkpoint {path} cannot be loaded: {problem}")
    state = check_trainer_state(read_trainer_state(path), path)
    weights = read_weights(path)
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
        opt = {k: f.get_tensor(k) for k in f.keys()}
    load_full_state(model, optimizer, weights, opt, state["optimizer"], source=path / "trainer.json")
    rank = accelerator.process_index
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        with safe_open(str(rng_file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        try:
            set_rng_state(tensors, json.loads((path / f"rng-rank{rank}.json").read_text()))
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise UserError(f"{path}: rng-rank{rank}.* cannot be read back ({type(e).__name__}: {e}); the checkpoint "
                            f"was altered: use another checkpoint") from None
    return state
