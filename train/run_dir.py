"""The run directory: one training run per ``output_dir``, and where a run starts, checked before anything loads.

An ``output_dir`` holds one run: ``checkpoints/``, ``metrics.jsonl``, ``summary.json``, ``export/``, and the
caches and logs beside them (``RUN_FILES``). Before the target and the data load, ``check_output_paths`` refuses
what would mix two runs or write over files that are not a run's, and checks an ``init_from`` drafter against
the run's settings; ``resume_point`` (under the run's lock) picks the checkpoint the run continues and checks it.

Design choices:
- ``resume=auto`` (the default) continues the newest complete checkpoint in output_dir, or starts the run there
  when there is none (a run killed before its first checkpoint starts again).
- ``resume=none`` into an earlier run's output_dir is refused: keep-last rotation, metrics.jsonl, summary.json and
  a later ``resume=auto`` would mix the two runs (the new run's step-5 sorted below the old step-40 and was
  deleted). ``overwrite=true`` starts over instead: the earlier run's checkpoints, metrics, summary, TensorBoard
  events, W&B run id and export are deleted first (the token cache and W&B's own files stay).
- ``resume=CKPT`` continues that checkpoint; into an output_dir holding a run, only that run's newest
  checkpoint (an older one would leave later checkpoints that ``resume=auto`` picks over the new ones).
- A checkpoint is checked when it is picked, before the target loads: complete (checkpoint.json's sizes and
  sha256), and trainer.json's fields of the expected types (train/checkpoint.check_trainer_state).
- A resume reads the data its checkpoint was trained on (train/data_fingerprint.py), checked here too.
- An ``init_from`` drafter keeps its own architecture: a setting of the run that differs from its default and
  from the drafter (block_size, num_hidden_layers, taps, layer types, window, ``drafter:`` fields, mask token,
  architecture) is refused naming each, never silently ignored. The drafter is loaded here too
  (dflashkit.drafter.load_drafter: its config, weight names, shapes and finiteness are checked there).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflashkit import launch
from dflashkit.errors import UserError

from .checkpoint import (
    STEP_DIR,
    check_trainer_state,
    checkpoint_step,
    checkpoints_root,
    latest_checkpoint,
    list_checkpoints,
    read_trainer_state,
    verify_checkpoint,
)
from .config import TrainConfig

RUN_FILES = ("checkpoints", "export", "metrics.jsonl", "summary.json", "token-cache", "tb", "wandb", "wandb-run-id")
# what a new run with overwrite=true deletes of an earlier run (the export directory too, when it is inside)
EARLIER_RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "tb", "wandb-run-id")
# TrainConfig fields that shape a drafter: an init_from drafter has its own
ARCHITECTURE_FIELDS = ("num_hidden_layers", "block_size", "target_layer_ids", "layer_types", "sliding_window",
                       "causal")


def main_process() -> bool:
    """Rank 0 of a launch, or a single process (before the accelerator exists: dflashkit/launch.py)."""
    return launch.ranks().rank == 0


def say(message: str) -> None:
    if main_process():
        print(message, flush=True)


def export_path(cfg: TrainConfig) -> Path:
    return Path(cfg.export_dir or Path(cfg.output_dir) / "export")


# --------------------------------------------------------------------------- what an output_dir holds
def foreign_run_files(path: Path, owned: frozenset) -> str | None:
    """Why directory ``path`` is not a training run's (entries no run writes), or None."""
    from dflashkit.outputs import describe_foreign, foreign_entries

    foreign = foreign_entries(path, lambda name: name in owned)
    return describe_foreign(foreign) if foreign else None


def earlier_run(cfg: TrainConfig) -> list[str]:
    """The entries of output_dir that an earlier run left: checkpoints, a non-empty metrics.jsonl, summary.json,
    a non-empty export inside output_dir; [] for a new (or empty) run directory."""
    out_dir = Path(cfg.output_dir)
    found = []
    root = checkpoints_root(out_dir)
    if root.is_dir() and any(STEP_DIR.match(p.name.removeprefix(".tmp-")) for p in root.iterdir()):
        found.append("checkpoints/")
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    if (out_dir / "summary.json").exists():
        found.append("summary.json")
    for export in {out_dir / "export", export_path(cfg)}:
        if export.parent == out_dir and export.is_dir() and any(export.iterdir()):
            found.append(f"{export.name}/")
    return found


def check_output_paths(cfg: TrainConfig) -> Path:
    """Refuse, before any work, an output_dir or export_dir that is, lies inside or contains what the run reads
    (``run_inputs``), an output_dir that holds files of something else (unless ``overwrite``), an export_dir that
    is not a drafter export, a file at either path always, a ``resume=none`` run into an earlier
    run's output_dir (unless ``overwrite``: the earlier run is deleted when the run starts), and an ``init_from``
    drafter that the run's settings contradict. Returns the export directory."""
    from dflashkit.drafter.export import export_dir_problem
    from dflashkit.outputs import check_apart, check_output_dir

    out_dir, export_dir = Path(cfg.output_dir), export_path(cfg)
    check_apart({"output_dir": out_dir, "export_dir": export_dir}, run_inputs(cfg))
    check_apart({"export_dir": export_dir}, {"output_dir/checkpoints": checkpoints_root(out_dir)}, existing_only=False)
    owned = frozenset({*RUN_FILES, export_dir.name} if export_dir.parent == out_dir else RUN_FILES)
    check_output_dir(out_dir, what="a training run directory", problem=functools.partial(foreign_run_files,
                     owned=owned), overwrite=cfg.overwrite, flag="overwrite=true", forcing="write into it anyway")
    check_output_dir(export_dir, what="a drafter directory", problem=export_dir_problem, overwrite=cfg.overwrite,
                     flag="overwrite=true")
    earlier = earlier_run(cfg) if cfg.resume in ("none", "") else []
    if earlier and not cfg.overwrite:
        raise UserError(f"output_dir {out_dir} holds an earlier run ({', '.join(earlier)}) and resume=none starts a "
                        f"new one, which would mix with it: resume=auto continues it, another output_dir keeps it, "
                        f"or overwrite=true deletes it and starts over")
    if cfg.init_from:
        check_init_from(cfg)
    return export_dir


def run_inputs(cfg: TrainConfig) -> dict:
    """What the run reads, by field, for the rule that no output overlaps an input (dflashkit/outputs.py
    ``check_apart``); a ``resume`` checkpoint of this output_dir is the run's own, not an input."""
    resume = cfg.resume if cfg.resume not in ("auto", "none", "") else None
    if resume and Path(resume).resolve().parent == checkpoints_root(cfg.output_dir).resolve():
        resume = None
    return {"shards": cfg.shards, "data": list(cfg.data), "target": cfg.target, "init_from": cfg.init_from,
            "chat_template": cfg.chat_template, "resume": resume}


def written_by_a_run(path: Path) -> list[Path]:
    """The entries of a run's directory ``path`` (checkpoints/, tb/, an export) that a training run wrote: step
    directories and their temporaries, TensorBoard event files, a drafter export's files."""
    from dflashkit.drafter.export import EXPORT_FILES, export_dir_problem

    if path.name == "checkpoints":
        return [p for p in path.iterdir() if STEP_DIR.match(p.name.removeprefix(".tmp-").removeprefix(".old-"))]
    if path.name == "tb":
        return [p for p in path.iterdir() if p.name.startswith("events.out.tfevents.") and p.is_file()]
    return [path / name for name in EXPORT_FILES if (path / name).exists()] if export_dir_problem(path) is None else []


# --------------------------------------------------------------------------- init_from
def config_default(name: str):
    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_init_from(cfg: TrainConfig) -> None:
    """The run's drafter settings must agree with the ``init_from`` drafter's config.json (read here, before the
    target loads): a fine-tuned drafter keeps its architecture, so a setting it cannot honour is refused."""
    from dflashkit.drafter.export import read_drafter_config

    dcfg = read_drafter_config(cfg.init_from)
    where = f"the drafter in {cfg.init_from}"
    if dcfg.architecture != cfg.drafter_architecture:
        raise UserError(f"drafter_architecture={cfg.drafter_architecture} but {where} is {dcfg.architecture}; set "
                        f"drafter_architecture={dcfg.architecture}")
    if cfg.mask_token_id is not None and dcfg.mask_token_id != cfg.mask_token_id:
        raise UserError(f"mask_token_id={cfg.mask_token_id} but {where} was trained with {dcfg.mask_token_id}; drop "
                        f"mask_token_id to keep the drafter's")
    asked = {name: getattr(cfg, name) for name in ARCHITECTURE_FIELDS if getattr(cfg, name) != config_default(name)}
    asked.update({f"drafter.{key}": value for key, value in cfg.drafter.items()})
    differ = [f"{name}={value} (the drafter: {getattr(dcfg, name.removeprefix('drafter.'), None)})"
              for name, value in asked.items() if getattr(dcfg, name.removeprefix("drafter."), None) != value]
    if differ:
        raise UserError(f"init_from={cfg.init_from}: {', '.join(differ)}; training from a drafter keeps its "
                        f"architecture: drop these settings (or set the drafter's values), or train a new drafter "
                        f"without init_from")


# --------------------------------------------------------------------------- where the run starts
@dataclass
class ResumePoint:
    """The checkpoint a run continues, checked: complete, and its trainer.json fields of the expected types."""

    path: Path
    state: dict  # its trainer.json


@dataclass
class Start:
    """Where a run starts, found and checked before the target and the data load (``start_of_run``)."""

    resume: ResumePoint | None  # the checkpoint the run continues; None: a new run
    init_model: object | None  # the init_from drafter (dflashkit.drafter.load_drafter checked it); None: a new one
    data: dict | None = None  # a resumed run's data fingerprint, checked against the checkpoint's (setup: a new run's)


def start_of_run(cfg: TrainConfig) -> Start:
    """Where the run starts (the module docstring); under the output_dir's lock, before the target loads. With
    ``resume=none`` and ``overwrite``, deletes an earlier run first."""
    init_model = None
    if cfg.init_from:  # its weights' names, shapes, dtype and finiteness are checked by load_drafter
        from dflashkit.drafter import load_drafter

        init_model = load_drafter(cfg.init_from)
    resume = resume_point(cfg)
    return Start(resume=resume, init_model=init_model, data=resumed_data(cfg, resume))


def resumed_data(cfg: TrainConfig, resume: ResumePoint | None) -> dict | None:
    """The data fingerprint of a resumed run, refused (before the target loads) when it is not the checkpoint's
    unless resume_other_data=true (train/data_fingerprint.py); None for a new run."""
    from dflashkit.extract.shards.manifest import read_manifest

    from .data_fingerprint import check_same_data, data_fingerprint

    if resume is None or not (cfg.data or cfg.shards):  # no data at all: setup says so
        return None
    data = data_fingerprint(cfg, None if cfg.data else read_manifest(cfg.shards))
    check_same_data(resume.state.get("data"), data, resume.path / "trainer.json", cfg.resume_other_data, say)
    return data


def resume_point(cfg: TrainConfig) -> ResumePoint | None:
    """The checkpoint ``cfg.resume`` names (auto: the newest complete one in output_dir), checked; None: a new run."""
    out_dir = Path(cfg.output_dir)
    if cfg.resume in ("none", ""):
        if cfg.overwrite and main_process():
            clear_earlier_run(cfg)
        return None
    if cfg.resume == "auto":
        path = latest_checkpoint(out_dir, warn=say)
        if path is None:
            return None
    else:
        path = Path(cfg.resume)
        check_resume_path(cfg, path)
    return ResumePoint(path, check_trainer_state(read_trainer_state(path), path))


def available(out_dir: Path) -> str:
    """What output_dir offers to resume from, for a message."""
    names = [p.name for p in list_checkpoints(out_dir) if verify_checkpoint(p, hashes=False) is None]
    if not names:
        return f"{out_dir} has no complete checkpoint to resume from (resume=none starts a new run)"
    return f"{out_dir}/checkpoints has {', '.join(names[-3:])} (resume=auto takes the newest)"


def check_resume_path(cfg: TrainConfig, path: Path) -> None:
    """``resume=PATH``: a complete checkpoint, and in an output_dir holding a run, that run's newest one."""
    out_dir = Path(cfg.output_dir)
    if not path.exists():
        raise UserError(f"resume={path}: no such checkpoint directory; {available(out_dir)}")
    problem = verify_checkpoint(path)
    if problem is not None:
        hint = "give a run's checkpoints/step-N directory" if (path / "checkpoints").is_dir() else available(out_dir)
        raise UserError(f"resume={path}: not a complete checkpoint ({problem}); {hint}")
    if not earlier_run(cfg):
        return
    if path.resolve().parent != checkpoints_root(out_dir).resolve() or not STEP_DIR.match(path.name):
        raise UserError(f"resume={path}: output_dir {out_dir} holds another run ({', '.join(earlier_run(cfg))}); "
                        f"resume=auto continues that run, or continue {path} into an empty output_dir")
    later = [p.name for p in list_checkpoints(out_dir)
             if checkpoint_step(p) > checkpoint_step(path) and verify_checkpoint(p, hashes=False) is None]
    if later:
        raise UserError(f"resume={path}: {out_dir} has later checkpoints ({', '.join(later)}), which a later "
                        f"resume=auto would take over this run's new ones; move them out of {out_dir}/checkpoints "
                        f"to go back to {path.name}, or use resume=auto")


def clear_earlier_run(cfg: TrainConfig) -> None:
    """overwrite=true with resume=none: delete what an earlier run left in output_dir, saying so; only what a run
    writes (``written_by_a_run``): anything else under those names is kept."""
    out_dir = Path(cfg.output_dir)
    export_dir = export_path(cfg)
    doomed = [out_dir / name for name in EARLIER_RUN_FILES]
    doomed += [p for p in {out_dir / "export", export_dir} if p.parent == out_dir]
    gone = []
    for p in doomed:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            for entry in written_by_a_run(p):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            if any(p.iterdir()):
                say(f"overwrite=true: kept {p}: it holds files no training run writes")
                continue
            p.rmdir()
        else:
            continue
        gone.append(p.name)
    if gone:
        say(f"overwrite=true, resume=none: deleted the earlier run's {', '.join(sorted(gone))} in {out_dir}")
