"""A training checkpoint pinned for reading: resolved once, its files opened once, checked from the open files.

A run that is still training rotates its old checkpoints away (keep_last) and may write a step again; an export
that resolved "the newest checkpoint" by name, read its files by name and named it again afterwards could read
one step's weights and print another step's name. So an export reads through ``pin_checkpoint``:

- The step directory is resolved once (a run directory: its newest complete checkpoint) and opened; every file
  that its checkpoint.json lists is opened relative to that open directory, so all of them come from the one
  directory that was resolved even if another takes its name meanwhile.
- An open file stays readable after a rotation deletes its name (Linux keeps the inode while a descriptor holds
  it), so once every file is open, nothing the training does can change what is read. The sizes and sha256 that
  checkpoint.json records are checked on the open files: what is read is exactly the step that is named.
- A directory removed before all its files were opened (rotated away at that moment) is resolved again when a
  run directory was given (up to ``_TRIES`` times), and stops in one line naming it when a step directory was.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.files import pause_point

from .checkpoint import FORMAT, REQUIRED_FILES, latest_checkpoint, verify_checkpoint

_TRIES = 3  # resolutions of a run directory whose newest checkpoint is rotated away while it is being opened


class _Vanished(Exception):
    """The step directory, or a file of it, was removed while it was being opened."""


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` names one checkpoint (not a run directory)."""
    return (path / "checkpoint.json").is_file() or path.name.startswith("step-")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, or a run's output dir (its newest complete checkpoint)."""
    path = Path(path)
    if is_step_dir(path):
        return path
    found = latest_checkpoint(path, warn=lambda msg: print(msg))
    if found is None:
        if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():  # a run that saved none yet
            raise UserError(f"{path}: the run has no complete checkpoint yet under {path}/checkpoints (train saves "
                            "one every save_every steps and at the end); export it after its first save")
        raise UserError(f"{path}: neither a checkpoint (checkpoint.json) nor a run directory with complete "
                        f"checkpoints under {path}/checkpoints; give a train output_dir or one of its "
                        "checkpoints/step-N directories")
    return found


@dataclass
class PinnedCheckpoint:
    """One checkpoint's files, open; ``with pin_checkpoint(path) as pinned:`` closes them."""

    path: Path  # the step directory as resolved
    step: int  # the step its checkpoint.json records
    fds: dict[str, int] = field(default_factory=dict)  # file name -> open descriptor

    def __enter__(self) -> PinnedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def read_bytes(self, name: str) -> bytes:
        return b"".join(_blocks(self.fds[name]))

    def trainer_state(self) -> dict:
        """trainer.json, read from the open file (the caller checks its fields: train/checkpoint.py)."""
        source = self.path / "trainer.json"
        try:
            state = json.loads(self.read_bytes("trainer.json"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{source}: not valid JSON ({e}); the checkpoint is damaged: use another checkpoint") \
                from None
        if not isinstance(state, dict):
            raise UserError(f"{source}: a {type(state).__name__}, not a JSON object; the checkpoint is damaged: use "
                            f"another checkpoint")
        return state

    def weights(self) -> dict:
        """model.safetensors' tensors, read from the open file (through /proc/self/fd, memory-mapped, where the
        system has it; else from its bytes)."""
        from safetensors import safe_open
        from safetensors.torch import load

        link = f"/proc/self/fd/{self.fds['model.safetensors']}"
        if not os.path.exists(link):
            return load(self.read_bytes("model.safetensors"))
        with safe_open(link, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def metadata(self) -> dict[str, str]:
        """What an export records of its source (safetensors metadata: strings only)."""
        return {"dflashkit_checkpoint": str(self.path), "dflashkit_step": str(self.step)}


def pin_checkpoint(given: str | os.PathLike) -> PinnedCheckpoint:
    """The checkpoint ``given`` names (a step directory, or a run directory's newest complete checkpoint), its
    files open and checked against its checkpoint.json; see the module docstring."""
    given = Path(given)
    if is_step_dir(given) and not given.is_dir():
        raise UserError(f"checkpoint {given} cannot be exported: no such directory")
    for attempt in range(_TRIES):
        path = resolve_checkpoint(given)
        if attempt == 0:
            pause_point("export-checkpoint-resolved", until=_released)  # crash tests: rotate it away now
        try:
            return _open_checkpoint(path)
        except _Vanished as gone:
            if is_step_dir(given):
                raise UserError(f"checkpoint {path} was removed while it was being read ({gone}); a training still "
                                f"running rotates old checkpoints away (keep_last): export a newer checkpoint, or "
                                f"the run directory (its newest)") from None
    raise UserError(f"{given}: its newest checkpoint was removed {_TRIES} times while being read (a training "
                    f"rotating checkpoints faster than they are read); export once the run has ended")


def _released() -> bool:
    """Whether the test holding an export at its pause point let it go on (it removes the pause file)."""
    return not os.path.exists(os.environ.get("DFLASHKIT_TEST_PAUSE_FILE", ""))


def _open_checkpoint(path: Path) -> PinnedCheckpoint:
    """``path``'s files opened relative to the open directory and checked (sizes, sha256) on the open files."""
    try:
        directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError as e:
        raise _Vanished(e.strerror) from None
    except NotADirectoryError:
        raise UserError(f"checkpoint {path} cannot be exported: not a directory") from None
    pinned = PinnedCheckpoint(path, step=-1)
    try:
        try:
            meta = _checkpoint_meta(pinned, directory)
            for name in meta["files"]:
                _open_file(pinned, directory, name)
        except _Vanished:
            if os.fstat(directory).st_nlink > 0:  # still there: not rotated away, written incompletely
                raise UserError(f"checkpoint {path} cannot be exported: "
                                f"{verify_checkpoint(path, hashes=False) or 'a file it lists is missing'}") from None
            raise
        for name, info in meta["files"].items():
            bad = _file_problem(pinned, name, info)
            if bad is not None:
                raise UserError(f"checkpoint {path} cannot be exported: {bad}")
    except BaseException:
        pinned.__exit__()
        raise
    finally:
        os.close(directory)
    pinned.step = meta["step"]
    return pinned


def _open_file(pinned: PinnedCheckpoint, directory: int, name: str) -> None:
    """Open ``name`` of the open ``directory`` into ``pinned``."""
    try:
        pinned.fds[name] = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=directory)
    except FileNotFoundError as e:
        raise _Vanished(f"{name}: {e.strerror}") from None


def _checkpoint_meta(pinned: PinnedCheckpoint, directory: int) -> dict:
    """checkpoint.json, opened and read into ``pinned``; its fields checked as verify_checkpoint does."""
    _open_file(pinned, directory, "checkpoint.json")
    where = f"checkpoint {pinned.path} cannot be exported: checkpoint.json"  # worded as verify_checkpoint's
    try:
        meta = json.loads(pinned.read_bytes("checkpoint.json"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{where} format {found!r}, expected {FORMAT!r}")
    files, step = meta.get("files"), meta.get("step")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        raise UserError(f"{where} field files does not list {list(REQUIRED_FILES)}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{where} field step is {step!r}, expected a whole number >= 0")
    for name, info in files.items():  # plain names of this directory, each with its size and sha256
        if "/" in name or name in ("", ".", "..") or not isinstance(info, dict) \
                or not isinstance(info.get("bytes"), int) or not isinstance(info.get("sha256"), str):
            raise UserError(f"{where} field files[{name!r}] is not {{bytes: int, sha256: str}} for a file here")
    return meta


def _file_problem(pinned: PinnedCheckpoint, name: str, info: dict) -> str | None:
    """Why the open file ``name`` is not the one checkpoint.json records (size, sha256), or None."""
    fd = pinned.fds[name]
    size = os.fstat(fd).st_size
    if size != info["bytes"]:
        return f"{name} has {size} bytes, checkpoint.json says {info['bytes']}"
    digest = hashlib.sha256()
    for block in _blocks(fd):
        digest.update(block)
    if digest.hexdigest() != info["sha256"]:
        return f"{name} does not match its sha256 in checkpoint.json (corrupted)"
    return None


def _blocks(fd: int, block: int = 1 << 24):
    """The bytes of the open file ``fd`` from its start, in blocks (``pread``: its offset is left alone)."""
    offset = 0
    while data := os.pread(fd, block, offset):
        yield data
        offset += len(data)
