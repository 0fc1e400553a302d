"""Output paths: what a command may replace, the file modes it writes, and one run per output.

Design choices:
- **Replace only your own kind.** A command replaces an existing output only when it holds what that command
  writes: the caller passes a recogniser (``drafter/export.py: export_dir_problem``, the trainer's run
  directory, an extraction) that says why a directory is *not* of its kind, or None. Anything else stops with one
  line naming the path and the flag that forces it (``--overwrite``; ``overwrite=true`` for train). A regular
  file or a symbolic link at an output directory's path is always an error: it is never renamed or removed.
- **Modes follow the umask.** Temporary directories are made with ``os.mkdir`` (mode 0777 less the umask), not
  ``tempfile.mkdtemp`` (0700); files that a library creates private (safetensors' ``save_file`` makes 0600) are
  given 0666 less the umask. Under the usual umask 022 exports, shards and checkpoints are 0644 / 0755, so a
  serving process running as another user can read them.
- **One run per output.** ``OutputLock`` is a lock file (``.dflashkit.lock`` inside an output directory, or
  ``NAME.lock`` beside an output file) holding the holder's pid, host, start time, command and launch id, kept
  under ``flock`` while the run lives. A second run stops at once naming the holder. The kernel drops the
  ``flock`` when the holder dies, so a lock left by a dead process on this host is taken over with a note; a
  lock written on another host whose ``flock`` this host cannot see is refused with the path to delete.
- **Ranks of one launch share the lock.** Under torchrun / ``accelerate launch`` (``WORLD_SIZE`` > 1) the launch
  id is the rendezvous run id and the master's address and port, which every rank of one launch has and two
  launches running at the same time cannot share (the second could not bind the port). A rank that finds the
  lock held by its own launch goes on; whichever rank wrote the lock removes it at exit.
- **Outputs apart from inputs.** Every command, before it touches anything, compares each path it writes with
  each path it reads (``check_apart``: data files and directories, shards, a checkpoint, a run's checkpoints, a
  drafter, a target), symbolic links resolved: an output that is, lies inside or contains an input stops in one
  line naming both, ``--overwrite`` or not. So no command writes over what it reads, nor reads back what it writes.
- **``--overwrite`` removes only what the command wrote.** A directory that a command replaces whole (an export,
  an extraction) is replaced only when its recogniser claims every entry, ``--overwrite`` included; the flag
  forces only a command that writes beside what is there (train's output_dir, eval's report directory).
- **Blocked paths are one line, early.** Before a command makes or writes its output, the nearest existing
  directory on the way to it must be a directory this process may write: a file where a directory should be, a
  directory without write permission and a read-only file system stop with one line naming the path and the fix
  (``check_writable``), instead of an ``OSError`` traceback from a ``mkdir`` or ``open`` later on.
- Release on exit: the lock is a context manager and also registered with ``atexit`` (a user error, a
  SIGTERM-driven checkpoint exit and a normal return all remove it; a killed process leaves a stale lock that
  the next run takes over).

This module imports nothing of the project but ``errors``, so every package may use it.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import secrets
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .errors import UserError
from .files import check_name_length

LOCK_NAME = ".dflashkit.lock"  # the lock file inside a locked output directory
_READ_TRIES = 200  # reads of a lock file another rank is writing right now (10 ms apart) before giving up


# --------------------------------------------------------------------------- file modes
def current_umask() -> int:
    """This process's umask (Linux: read from /proc, which changes nothing; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give a file the mode an ordinary ``open`` would (0666 less the umask; directories 0777 less it)."""
    path = Path(path)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~current_umask())


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new, uniquely named directory in ``parent`` whose mode follows the umask (unlike ``mkdtemp``'s 0700)."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
        except OSError as error:  # no permission, a read-only file system: one line, not a traceback
            raise blocked_error(error, parent, "a temporary directory") or error from None
    raise FileExistsError(f"{parent}: could not make a temporary directory {prefix}*")


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` with the file's mode following the umask (save_file makes it 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    honour_umask(path)


# --------------------------------------------------------------------------- paths that cannot be written
# errno values of a write refused by permissions or by a read-only mount: the user's to fix, not a failure
_BLOCKED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``lexists``: a dangling link counts as being there)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def _not_writable(directory: Path) -> str | None:
    """Why this process cannot create entries in the existing ``directory``, or None when it can."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "on a read-only file system"
    except OSError:
        pass
    effective = os.access in os.supports_effective_ids  # set-uid runs: what the kernel will check
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=effective):
        return f"not writable by this user (mode {stat.S_IMODE(os.stat(directory).st_mode):o})"
    return None


def check_writable(path: str | os.PathLike, what: str, *, beside: bool = False) -> None:
    """One-line ``UserError`` when ``path`` (a directory or file a command is about to make or write) cannot be
    written: the closest existing directory on the way is a file, is not writable, or lies on a read-only file
    system. ``beside``: the command also writes next to ``path`` (a temporary sibling renamed into place), so the
    parent must be writable even when ``path`` exists."""
    path = Path(path)
    _check_no_link_loop(path)
    places = [path.parent] if beside or not path.is_dir() else [path]
    if beside and path.is_dir():
        places.append(path)
    for place in places:
        found = _nearest_existing(place)
        if not found.is_dir():
            kind = "a file" if found.is_file() else "not a directory"
            raise UserError(f"{path}: {found} is {kind}, so {what} cannot be made there; move it away or pick "
                            f"another path")
        reason = _not_writable(found)
        if reason:
            raise UserError(f"{path}: cannot write {what} there: {found} is {reason}; pick a path on a writable "
                            f"file system or make {found} writable")


def _check_no_link_loop(path: Path) -> None:
    """One-line ``UserError`` when ``path``, or a folder on its way, is a symbolic link that leads back to itself
    (pathlib reads such a path as missing; opening it fails with ELOOP)."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UserError(f"{path}: a loop of symbolic links on the way; remove the link or pick another "
                            f"path") from None


def blocked_error(error: OSError, path: str | os.PathLike, what: str) -> UserError | None:
    """The one-line ``UserError`` for an ``OSError`` that a blocked path raised (no permission, read-only file
    system, a file where a directory should be), or None for other errors (a full disk: files.disk_full_error)."""
    if error.errno in _BLOCKED:
        return UserError(f"{path}: cannot write {what} there ({error.strerror}: {error.filename}); pick a path on a "
                         f"writable file system or make it writable")
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        return UserError(f"{path}: a file is in the way of {what} ({error.filename}); move it away or pick "
                         f"another path")
    return None


# --------------------------------------------------------------------------- outputs apart from inputs
def _resolved(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))


def _relation(output: str, source: str) -> str | None:
    """How the resolved ``output`` stands to the resolved input ``source``: "is", "lies inside", "contains"."""
    if output == source:
        return "is"
    if output.startswith(source.rstrip(os.sep) + os.sep):
        return "lies inside"
    if source.startswith(output.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:  # another name of one file (a hard link, a bind mount) is that file
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_apart(outputs: dict, inputs: dict, *, existing_only: bool = True) -> None:
    """The one rule between what a command writes and what it reads, called before it touches anything: an
    output path (``outputs``: flag -> path or None) that is, lies inside or contains an input (``inputs``: flag ->
    a path, a list of paths or None), symbolic links resolved, stops in one line naming both and the fix,
    ``--overwrite`` or not. Inputs that name no existing local path (``builtin:``, ``testbed:``, a hub model name,
    a URL) are not compared; ``existing_only=False`` compares paths that a run will make too."""
    for out_flag, out in outputs.items():
        if not out:
            continue
        for in_flag, given in inputs.items():
            for source in given if isinstance(given, (list, tuple)) else [given]:
                if not source or (existing_only and not os.path.lexists(os.path.expanduser(os.fspath(source)))):
                    continue
                relation = _relation(_resolved(out), _resolved(source)) or ("is" if _same_file(out, source) else None)
                if relation is not None:
                    raise UserError(_apart_message(out_flag, out, relation, in_flag, source))


def _apart_message(out_flag: str, out, relation: str, in_flag: str, source) -> str:
    """The one line of ``check_apart``: both paths as given (and where a link leads), the rule and the fix."""
    shown = {os.path.abspath(out): _resolved(out), os.path.abspath(source): _resolved(source)}
    links = [f"{given} -> {real}" for given, real in shown.items() if given != real]
    fix = {"is": f"pick another {out_flag}", "lies inside": f"pick an {out_flag} outside {source}",
           "contains": f"pick an {out_flag} that does not hold {source}"}[relation]
    note = f" ({', '.join(links)})" if links else ""
    return (f"{out_flag} {out} {relation} the input {in_flag} {source}{note}: a command never writes where it "
            f"reads, --overwrite or not; {fix}")


# --------------------------------------------------------------------------- what may be replaced
def check_output_dir(path: str | os.PathLike, *, what: str, problem: Callable[[Path], str | None],
                     overwrite: bool, flag: str = "--overwrite", forcing: str | None = None,
                     beside: bool = False) -> bool:
    """Whether ``path`` may be written as ``what`` (e.g. "a drafter directory"); True when something is there to
    replace. ``problem(path)`` says why an existing, non-empty directory is not of that kind (None: it is).
    Raises a one-line ``UserError`` for a file or link in the way (always), for a path that cannot be written
    (``check_writable``; ``beside``: the output is written as a temporary sibling and renamed into place) and for a
    directory of another kind. ``forcing``: what ``flag`` (``overwrite``) does for a command that writes beside
    what is there; None (a command that replaces the directory whole) and nothing forces it: a command removes
    only what it wrote."""
    path = Path(path)
    check_name_length(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        kind = "a symbolic link" if path.is_symlink() else "a file"
        raise UserError(f"{path}: {kind} is in the way of {what}; move it away or pick another path "
                        f"(it is never replaced, {flag} or not)")
    check_writable(path, what, beside=beside)
    if not path.is_dir() or not [p for p in path.iterdir() if p.name != LOCK_NAME]:
        return False
    if overwrite and forcing is not None:
        return True
    reason = problem(path)
    if reason is None:
        return True
    if forcing is None:
        raise UserError(f"{path}: not {what} ({reason}); dflashkit removes only what it wrote, {flag} or not: move "
                        f"those files away or pick another path")
    raise UserError(f"{path}: not {what} ({reason}); pick another path, or pass {flag} to {forcing}")


def foreign_entries(path: Path, owned: Callable[[str], bool]) -> list[str]:
    """Names in directory ``path`` that ``owned(name)`` does not claim (the lock file is always claimed)."""
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME and not owned(p.name))


def describe_foreign(names: list[str]) -> str:
    return f"it holds {names[:4]}{' ...' if len(names) > 4 else ''}"


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """An output file's path must not be a directory."""
    path = Path(path)
    check_name_length(path)
    if path.is_dir():
        raise UserError(f"{path}: a directory is in the way of {what}; give a file path")
    check_writable(path, what)
    if path.is_file() and not os.access(path, os.W_OK):
        raise UserError(f"{path}: cannot write {what} there: the file is not writable by this user; make it "
                        f"writable or pick another path")


def check_resume_flags(out: str | os.PathLike, *, resume: bool, overwrite: bool, holds: str | None) -> None:
    """The rule of a command whose killed run can be continued (extract, regenerate): ``--resume`` and
    ``--overwrite`` exclude each other, and an output that already holds something (``holds`` says what: "an
    extraction"; None: nothing) is written only when one of them says whether to continue or replace it."""
    if resume and overwrite:
        raise UserError("--resume continues what --out holds and --overwrite replaces it: pass one of them")
    if holds is not None and not (resume or overwrite):
        raise UserError(f"{out} already holds {holds}: add --resume to continue it, --overwrite to replace it, "
                        f"or pick another --out")


# --------------------------------------------------------------------------- one run per output
def launch_id() -> str | None:
    """What the ranks of one torchrun / accelerate launch share; None for a single process."""
    from dflashkit.launch import ranks

    if ranks().world_size <= 1:
        return None
    addr = os.environ.get("MASTER_ADDR", "")
    if addr in ("", "localhost", "::1") or addr.startswith("127."):  # single-node defaults repeat on every host
        addr = f"{addr}/{socket.gethostname()}"
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}@{addr}:{os.environ.get('MASTER_PORT', '')}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_flock(fd: int) -> bool | None:
    """True: this process now holds the lock; False: another process does; None: the file system has no flock."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise


def _read_holder(path: Path, wait: bool) -> dict | None:
    """The lock file's record; None when it is gone or (``wait`` False) empty. With ``wait`` (another process holds
    the lock and may be writing its record right now) an empty or partly written file is read again."""
    for _ in range(_READ_TRIES if wait else 1):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            if isinstance(holder, dict) and "pid" in holder:
                return holder
        except json.JSONDecodeError:
            pass
        if wait:
            time.sleep(0.01)
    return {"pid": "?", "host": "?", "since": "?", "command": "?", "launch": None} if wait else None


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"


class OutputLock:
    """An exclusive lock on one output (see the module docstring); ``with OutputLock(dir, "train"):``.

    ``target``: the output directory (the lock file goes inside it, the directory is created) or, with
    ``sidecar=True``, an output file (the lock is ``NAME.lock`` beside it)."""

    def __init__(self, target: str | os.PathLike, command: str, *, sidecar: bool = False):
        self.target = Path(target)
        self.command = command  # the holder's command, named to a second run
        self.path = self.target.with_name(self.target.name + ".lock") if sidecar else self.target / LOCK_NAME
        self.fd: int | None = None  # open while this process holds the lock
        self.shared = False  # True: another rank of this launch holds it

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        what = f"the output of dflashkit {self.command}"
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise UserError(f"{self.path.parent}: a file is in the way of {what}; move it away or pick another path")
        check_writable(self.path.parent, what)  # where the lock file (and the output) go
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise blocked_error(error, self.path.parent, what) or error from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": self.command, "launch": launch_id()}
        while True:
            try:  # never through a symbolic link, never a device or FIFO: the lock file is ours or refused
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError as error:
                raise UserError(f"{self.path}: cannot be used as the lock of dflashkit {self.command} ({error}); "
                                f"move it away") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UserError(f"{self.path}: not a regular file, so not a dflashkit lock; move it away")
            got = _try_flock(fd)
            if not os.path.exists(self.path) or os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                os.close(fd)  # the holder removed the file between our open and flock: try the new one
                continue
            holder = _read_holder(self.path, wait=got is False)
            if holder is None and got is False:
                os.close(fd)
                continue
            if holder is None and os.fstat(fd).st_size:  # no one holds it and it is no lock record: a user's file
                os.close(fd)
                raise UserError(f"{self.path}: not a dflashkit lock (no lock record in it); move it away")
            ours = holder is not None and me["launch"] is not None and holder.get("launch") == me["launch"]
            elsewhere = holder is not None and holder.get("host") != me["host"]  # flock cannot see that host
            alive = got is False or (got is None and holder is not None and not elsewhere
                                     and _pid_alive(int(holder["pid"])))
            if ours and (alive or elsewhere):
                os.close(fd)  # another rank of this launch holds it: share
                self.shared = True
                return
            if alive:
                os.close(fd)
                raise UserError(f"{self.target} is in use by another dflashkit {holder.get('command')} run "
                                f"({_describe(holder)}; lock {self.path}); wait for it to end or pick another output")
            if elsewhere:
                os.close(fd)
                raise UserError(f"{self.target} is locked by a dflashkit {holder.get('command')} run on another "
                                f"host ({_describe(holder)}; lock {self.path}); if that run has ended, delete "
                                f"{self.path}")
            if holder is not None and not ours:
                print(f"note: {self.path}: took over the lock of a dflashkit {holder.get('command')} run that is no "
                      f"longer running ({_describe(holder)})", file=sys.stderr)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            honour_umask(self.path)
            self.fd = fd
            atexit.register(self.release)
            return

    def release(self) -> None:
        """Remove the lock if this process wrote it (idempotent)."""
        if self.fd is None:
            return
        try:
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = None
            atexit.unregister(self.release)
