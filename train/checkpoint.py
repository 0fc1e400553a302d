"""Training checkpoints: written whole or not at all, safetensors + JSON only, the same layout for every backend.

A checkpoint ``<output_dir>/checkpoints/step-00001200/`` holds:
- ``model.safetensors``: the drafter's fp32 master weights, full (unsharded) tensors under their module names;
- ``optimizer.safetensors``: AdamW state per parameter (``state.<name>.exp_avg``, ``.exp_avg_sq``, ``.step``);
- ``trainer.json``: step, epoch, samples of the epoch consumed, the TrainConfig, the DrafterConfig, the
  optimizer's hyper-parameters, world size;
- ``rng-rank<r>.safetensors`` + ``rng-rank<r>.json``: every rank's torch / CUDA / Python / NumPy RNG state;
- ``checkpoint.json`` (written last): byte size and sha256 of every file above.

Design choices:
- Nothing of the target is saved (its embedding, norm and lm_head are frozen inputs, re-read at start).
- No pickle: optimizer state is flattened into safetensors, everything else is JSON. Model and optimizer
  states are gathered to full tensors (``torch.distributed.checkpoint.state_dict`` for plain / DDP / FSDP
  models, DeepSpeed's tensor-fragment API for ZeRO), so a checkpoint resumes under any backend and
  world size.
- Atomicity: files go to ``.tmp-step-XXXXXXXX/`` (fsync'd), ``checkpoint.json`` last, then one rename. A
  directory without a valid ``checkpoint.json``, or whose files do not match it, is never loaded;
  ``--resume auto`` skips it (with a warning naming it) and takes the newest complete one.
- keep-last-k deletes the oldest complete checkpoints after a new one is in place.
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

from dflashkit.files import fsync_dir, pause_point, sha256_file
from dflashkit.outputs import save_safetensors

STEP_DIR = re.compile(r"^step-(\d{8})$")
FORMAT = "dflashkit-train-checkpoint-v1"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def verify_checkpoint(path: str | os.PathLike, hashes: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    path = Path(path)
    meta_file = path / "checkpoint.json"
    if not meta_file.is_file():
        return "no checkpoint.json (the write did not finish)"
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        return f"checkpoint.json is not valid JSON (line {e.lineno})"
    if meta.get("format") != FORMAT:
        return f"checkpoint.json format {meta.get('format')!r}, expected {FORMAT!r}"
    for name, info in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, checkpoint.json says {info['bytes']}"
        if hashes and sha256_file(f) != info["sha256"]:
            return f"{name} does not match its sha256 in checkpoint.json (corrupted)"
    return None


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


# --------------------------------------------------------------------------- gathering full state
def _is_deepspeed(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def _unwrapped(model):
    return model.module if hasattr(model, "module") else model


def _link_deepspeed_optimizer_state(engine, create: bool = False) -> None:
    """DeepSpeed links each parameter to its slice of the flat AdamW state lazily, at the first step. For a
    resume before any step, create zero AdamW state and link it now, so the full state can be written in."""
    zero = engine.optimizer
    base = zero.optimizer
    if create:
        flat = [p for g in base.param_groups for p in g["params"]]
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
            flat += list(getattr(zero, attr, None) or [])
        for p in flat:
            if not base.state.get(p):
                base.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if hasattr(zero, "_hp_optimizer_states_linked"):  # it may have been linked while the state was empty
        zero._hp_optimizer_states_linked = False
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2; ZeRO-3 reads the flat state directly
        zero._lazy_init_hp_params_optimizer_state()


def full_state(model, optimizer) -> tuple[dict, dict, dict]:
    """(model fp32 tensors, optimizer tensors, optimizer JSON) as full tensors; every rank must call it."""
    if _is_deepspeed(model):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        _link_deepspeed_optimizer_state(model)
        weights, opt = {}, {}
        for name, p in model.module.named_parameters():
            weights[name] = safe_get_full_fp32_param(p).detach().float().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    opt[f"state.{name}.{key}"] = value.detach().float().cpu()
        base = model.optimizer.optimizer
        steps = [s["step"] for s in base.state.values() if "step" in s]
        step = float(steps[0]) if steps else 0.0
        for name, _ in model.module.named_parameters():
            if f"state.{name}.exp_avg" in opt:
                opt[f"state.{name}.step"] = torch.tensor(step)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        return weights, opt, {"param_groups": _jsonable(groups)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = {k: v.detach().float().cpu() for k, v in get_model_state_dict(model, options=opts).items()
               if not k.startswith("rotary_emb.")}
    osd = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=opts)
    if "state" not in osd:  # with cpu_offload only rank 0 receives the full state
        return weights, {}, {}
    opt = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            opt[f"state.{name}.{key}"] = (value if torch.is_tensor(value) else torch.tensor(value)).detach().cpu()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
              for g in osd["param_groups"]]
    return weights, opt, {"param_groups": _jsonable(groups)}


def load_full_state(model, optimizer, weights: dict, opt: dict, opt_json: dict) -> None:
    """Put full tensors back into a (possibly sharded) model and optimizer; every rank must call it."""
    if _is_deepspeed(model):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        _link_deepspeed_optimizer_state(model, create=True)
        import deepspeed

        step = None
        for name, p in model.module.named_parameters():
            safe_set_full_fp32_param(p, weights[name].to(p.device))
            # the working (bf16) copy is refreshed from the fp32 master only at the next step: set it too
            if hasattr(p, "ds_id"):  # ZeRO-3: partitioned
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(weights[name].to(p.dtype))
            else:
                p.data.copy_(weights[name].to(p.dtype))
            for key in ("exp_avg", "exp_avg_sq"):
                if f"state.{name}.{key}" in opt:
                    safe_set_full_optimizer_state(p, opt[f"state.{name}.{key}"].to(p.device), key)
            if f"state.{name}.step" in opt:
                step = opt[f"state.{name}.step"]
        if step is not None:
            for s in model.optimizer.optimizer.state.values():
                if "step" in s:
                    s["step"] = step.to(s["step"].device) if torch.is_tensor(s["step"]) else int(step)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    current = _unwrapped(model).state_dict()
    full = {k: weights[k] if k in weights else v for k, v in current.items()}
    missing = sorted(k for k in current if k not in weights and not k.startswith("rotary_emb."))
    if missing:
        raise ValueError(f"checkpoint lacks drafter tensors {missing[:5]}: it was written for another drafter")
    set_model_state_dict(model, full, options=opts)
    state: dict = {}
    for key, value in opt.items():
        name, field = key[len("state."):].rsplit(".", 1)
        state.setdefault(name, {})[field] = value
    groups = opt_json["param_groups"]
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),
                             {"state": state, "param_groups": groups}, options=opts)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


# --------------------------------------------------------------------------- RNG
def rng_state() -> tuple[dict, dict]:
    import numpy as np

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    info = {"python": _jsonable(random.getstate()),
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
    rank = accelerator.process_index
    rng_tensors, rng_info = rng_state()
    save_safetensors(rng_tensors, tmp / f"rng-rank{rank}.safetensors")
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_info))
    if accelerator.is_main_process:
        save_safetensors({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors",
                         metadata={"format": "pt"})
        save_safetensors({k: v.contiguous() for k, v in opt.items()}, tmp / "optimizer.safetensors")
        state = dict(trainer_state, optimizer=opt_json, world_size=accelerator.num_processes)
        (tmp / "trainer.json").write_text(json.dumps(_jsonable(state), indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {}
        for f in sorted(tmp.iterdir()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        meta = {"format": FORMAT, "step": step, "files": files}
        with open(tmp / "checkpoint.json", "w") as fh:
            fh.write(json.dumps(meta, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():  # a re-run of the same step replaces the old copy
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
        complete = [p for p in list_checkpoints(output_dir) if verify_checkpoint(p, hashes=False) is None]
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        pause_point(f"checkpoint-{step}-saved")
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "trainer.json").read_text())


def read_weights(path: str | os.PathLike) -> dict:
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_checkpoint(path: str | os.PathLike, accelerator, model, optimizer) -> dict:
    """Restore weights, optimizer and this rank's RNG; returns trainer.json. Refuses incomplete checkpoints."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
    state = read_trainer_state(path)
    weights = read_weights(path)
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
        opt = {k: f.get_tensor(k) for k in f.keys()}
    load_full_state(model, optimizer, weights, opt, state["optimizer"])
    rank = accelerator.process_index
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        with safe_open(str(rng_file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        set_rng_state(tensors, json.loads((path / f"rng-rank{rank}.json").read_text()))
    return state
