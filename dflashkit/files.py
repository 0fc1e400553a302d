"""Durable files: every file of the project that must survive a crash is written through this module; the sha256
of what is written; the fault-injection hook of the crash tests.

The guarantee (stated here only): when a write returns, what it wrote is on the disk; a crash at any point leaves
either what was there before or the whole new content, never a part of it, plus at most temporary names that the
next run removes. One sequence keeps it: the bytes go to a temporary name, are fsynced, the temporary is renamed
over the final name, and the directory holding that name is fsynced (so the rename survives too). Its shapes:
- one file from memory: ``atomic_write`` (bytes, or buffers written one after another);
- one file that a library writes to a path (safetensors' ``save_file``): ``atomic_write_with``;
- files written ahead without a name, named later in order: ``write_unnamed`` + ``publish`` (shards);
- a directory (a drafter export, a training checkpoint, a converted GGUF target): its files written into a
  temporary directory beside it, ``fsync_tree`` (every file, then the directory), one rename into place (the commit
  point), ``fsync_dir`` of the parent; ``rename_dir_into_place`` does the last three where nothing is in the way,
  ``swap_dir_into_place`` where the previous directory is moved aside first;
- an append log (regenerate's JSONL, continued by --resume; training's metrics.jsonl): ``open_appending`` makes
  the file's name durable before a line is written, ``sync`` after each batch of lines. The one shape that keeps
  the old content and adds to it: a crash leaves every line synced so far plus at most one cut last line, which
  the reader drops and a continuing writer cuts off first (``whole_lines``).

Design choices:
- Buffers are written as they are (no joining copy), gathered or split into write calls of ``_CHUNK_BYTES``
  (``writev``); after each, the disk's write-back of that chunk is started (``sync_file_range``), so the disk works
  while the next chunk is copied and the final fsync has little left to wait for. Chunks are large because each
  system call gives up the interpreter lock and must take it back: while the forward's thread holds the lock (a
  GPU-bound forward does, nearly always), a writer thread gets it back only at the switch interval (5 ms), so
  16 MB chunks cost a shard of 671 MB ~0.4 s of waiting; 256 MB chunks ~25 ms.
- ``atomic_write``: a crash leaves either the old file or the new one, plus at most a temporary file that a
  resumed run removes. Temporary names are the file's name with a dot before and ``.tmp`` after, its end replaced
  by a hash where that would pass the file system's name limit (``fitted_name``).
- ``write_unnamed`` + ``publish`` (Linux ``O_TMPFILE``): the bytes are written and fsynced into a file that is in
  no directory, then linked under the temporary name and renamed like ``atomic_write``. Several such files can be
  written at once and named one at a time, in order: the directory goes through the states of writing them one
  after another, and a crash leaves nothing of the unnamed ones.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from dflashkit.errors import UserError


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    """sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- a full disk
# what the system says when a write does not fit; the environment's, not a bug: a UserError (exit 2)
DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
             errno.EFBIG: "the file-size limit (ulimit -f) is reached"}


def disk_full_errno(error: BaseException) -> int | None:
    """The errno of ``DISK_FULL`` that ``error`` carries: an OSError's, or the ``os error N`` of a library that
    writes in native code and says it in its message (safetensors); else None."""
    if isinstance(error, OSError):
        return error.errno if error.errno in DISK_FULL else None
    found = re.search(r"os error (\d+)", str(error)) if type(error).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found and int(found.group(1)) in DISK_FULL else None


def disk_full_error(code: int, path: str | os.PathLike, nbytes: int | None = None,
                    then: str = "run the command again") -> UserError:
    """The one line for a write to ``path`` that the disk did not take: what the system said, the bytes the write
    needed where known, the bytes free there, and the fix."""
    existing = next((p for p in Path(os.path.abspath(path)).parents if p.is_dir()), Path("/"))
    free = shutil.disk_usage(existing).free
    needed = f" of {nbytes} bytes" if nbytes is not None else ""
    return UserError(f"{path}: {DISK_FULL[code]} (a write{needed} failed; {free} bytes free on {existing}'s file "
                     f"system); free space, raise the limit or pick another path, then {then}")


@contextlib.contextmanager
def disk_full_is_user_error(path: str | os.PathLike, then: str = "run the command again"):
    """A command's writes under ``path``: a full disk met inside (``DISK_FULL``) leaves as one ``UserError``;
    every other error keeps its traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        code = disk_full_errno(error)
        if code is None:
            raise
        raise disk_full_error(code, getattr(error, "filename", None) or path, then=then) from error


def fsync_file(path: Path) -> None:
    """Make the bytes of the file ``path`` (written by this or another process) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename (or a new name) inside the directory ``path`` durable."""
    fsync_file(path)  # a directory opened read-only is fsynced as a file is


def pause_point(name: str, until=None) -> None:
    """Fault-injection hook for the crash tests: when ``DFLASHKIT_TEST_PAUSE_AT`` equals ``name``, write ``name`` to
    the file ``DFLASHKIT_TEST_PAUSE_FILE`` and sleep until killed, or until the callable ``until`` returns True (a
    signal handler asked the process to stop). A test can then signal the process at an exact point of its work
    instead of after a random delay. Does nothing when the variable is unset."""
    if os.environ.get("DFLASHKIT_TEST_PAUSE_AT") != name:
        return
    import time

    Path(os.environ["DFLASHKIT_TEST_PAUSE_FILE"]).write_text(name)
    while until is None or not until():
        time.sleep(60 if until is None else 0.01)


_CHUNK_BYTES = 256 << 20  # bytes per write call; the disk starts on a chunk while the next one is copied
_MAX_BUFFERS = 512  # buffers per writev call (the system's limit, IOV_MAX, is 1024 on Linux)


def _sync_file_range():
    """Linux's sync_file_range from the C library, or None (elsewhere)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages to the disk; do not wait


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a just-written range to the disk now, not at the fsync: the disk works while the next chunk
    is copied. Only a hint: where it is missing or fails, the fsync writes everything."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _byte_views(data) -> list[memoryview]:
    return [memoryview(data).cast("B")] if isinstance(data, (bytes, bytearray)) else \
        [memoryview(b).cast("B") for b in data]


def sha256_of(data) -> str:
    """sha256 of ``data`` (bytes, or a list of buffers taken one after another), read in place (no copy)."""
    h = hashlib.sha256()
    for b in _byte_views(data):
        h.update(b)  # releases the GIL on large buffers
    return h.hexdigest()


def _chunks(buffers: list[memoryview]):
    """The buffers' bytes, in order, as lists of views of at most ``_CHUNK_BYTES`` (and ``_MAX_BUFFERS`` views)."""
    chunk, size = [], 0
    for buf in buffers:
        lo = 0
        while lo < buf.nbytes:
            part = buf[lo: lo + _CHUNK_BYTES - size]
            chunk.append(part)
            size += part.nbytes
            lo += part.nbytes
            if size == _CHUNK_BYTES or len(chunk) == _MAX_BUFFERS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def _write_chunk(fd: int, chunk: list[memoryview]) -> None:
    """All of ``chunk``'s bytes, in as few system calls as the system allows (one, normally)."""
    while chunk:
        n = os.writev(fd, chunk) if hasattr(os, "writev") else os.write(fd, chunk[0])
        while chunk and n >= chunk[0].nbytes:  # writev may write less than asked: go on after what it wrote
            n -= chunk[0].nbytes
            chunk = chunk[1:]
        if n:
            chunk = [chunk[0][n:], *chunk[1:]]


def _write_buffers(fd: int, buffers: list[memoryview]) -> None:
    """The buffers one after another, in write calls of at most ``_CHUNK_BYTES`` (``_chunks``), each chunk's write
    to the disk started at once (``_start_writeback``); then fsync."""
    written = 0
    for chunk in _chunks([b for b in buffers if b.nbytes]):
        _write_chunk(fd, chunk)
        start, written = written, written + sum(b.nbytes for b in chunk)
        if written - start >= 1 << 20:
            _start_writeback(fd, start, written - start)
    os.fsync(fd)


NAME_MAX = 255  # bytes in a file name where the file system cannot be asked (ext4, xfs, btrfs: 255)


def name_limit(directory: Path) -> int:
    """The longest file name, in bytes, that ``directory``'s file system allows."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def check_name_length(path: str | os.PathLike) -> None:
    """UserError when a name on ``path`` that does not exist yet is longer than its file system allows (the
    nearest existing folder's limit), before any call that would fail on it with ENAMETOOLONG."""
    path = Path(os.path.abspath(path))
    existing = next((p for p in path.parents if p.is_dir()), Path("/"))
    limit = name_limit(existing)
    for part in path.relative_to(existing).parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise UserError(f"{path}: the name {part[:40]}... is {size} bytes, more than the {limit} its file "
                            f"system allows; pick a shorter name")


def fitted_name(name: str, extra: int, limit: int = NAME_MAX) -> str:
    """``name``, or, when ``extra`` more bytes around it would pass ``limit``, its beginning + ``~`` + 8 hex digits
    of its sha256: a temporary or sibling name made from a name the file system allows never passes its limit,
    stays recognisable, and differs between names that share their beginning."""
    if len(os.fsencode(name)) + extra <= limit:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    head = name
    while head and len(os.fsencode(head)) + extra + 1 + len(digest) > limit:
        head = head[:-1]  # whole characters: a name of multi-byte characters is never cut inside one
    return f"{head}~{digest}"


def _temporary(path: Path) -> Path:
    """``.NAME.tmp`` beside ``path``, shortened where NAME is close to the file system's limit (``fitted_name``)."""
    return path.with_name(f".{fitted_name(path.name, len('..tmp'), name_limit(path.parent))}.tmp")


def atomic_write(path: Path, data, pause_name: str | None = None, sha256=None) -> str:
    """Write ``data`` (bytes, or a list of buffers written one after another) under a temporary name, fsync,
    rename over ``path``, fsync the directory; return the sha256 of what was written.

    The buffers are written as they are (no joining copy; ``_write_buffers``). ``sha256``: a Future computing
    ``sha256_of(data)`` on another thread (it may run ahead of, or beside, the write; it must be done with the
    buffers when this returns or raises, so it is waited for either way); without it the hash is computed here
    after the write. ``pause_name``: a ``pause_point`` between the fsync and the rename (crash tests)."""
    path = Path(path)
    buffers = _byte_views(data)
    tmp = _temporary(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides (0644 under 022)
        try:
            _write_buffers(fd, buffers)
        finally:
            os.close(fd)
        digest = sha256.result() if sha256 is not None else sha256_of(buffers)
    except BaseException as error:
        if sha256 is not None:
            sha256.cancel() or sha256.exception()  # the hash thread must be done with the buffers
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(error)
        if code is not None:
            raise disk_full_error(code, path, sum(b.nbytes for b in buffers)) from error
        raise
    _rename_into_place(tmp, path, pause_name)
    return digest


def _rename_into_place(tmp: Path, path: Path, pause_name: str | None) -> None:
    """The end every atomic write shares, once ``tmp`` holds the durable bytes: the ``pause_point`` of the crash
    tests, the rename over ``path`` (``tmp`` removed if that fails), the directory fsynced."""
    try:
        if pause_name:
            pause_point(pause_name)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_with(path: Path, write: Callable[[Path], None], pause_name: str | None = None) -> None:
    """``atomic_write`` for a file that a library writes to a path: ``write(tmp)`` writes it under the temporary
    name; it is then fsynced, renamed over ``path`` and the directory fsynced. ``pause_name``: a ``pause_point``
    between the fsync and the rename (crash tests)."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        write(tmp)
        fsync_file(tmp)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(error)
        if code is not None:
            raise disk_full_error(code, path) from error
        raise
    _rename_into_place(tmp, path, pause_name)


def fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory``, then each directory (children first, ``directory`` last): all that
    was written into it is durable before the caller renames it into place (and then fsyncs its parent). Symbolic
    links are neither followed nor synced."""
    for root, _, names in os.walk(directory, topdown=False):
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                fsync_file(Path(root, name))
        fsync_dir(Path(root))


def rename_dir_into_place(tmp: Path, path: Path) -> None:
    """The end of the directory shape: everything written into the temporary directory ``tmp`` made durable
    (``fsync_tree``), ``tmp`` renamed to ``path`` (the commit point; nothing may be at ``path``), the parent
    fsynced so the rename survives too."""
    path = Path(path)
    fsync_tree(Path(tmp))
    os.rename(tmp, path)
    fsync_dir(path.parent)


def swap_dir_into_place(tmp: Path, path: Path, aside: Path, pause_name: str | None = None) -> None:
    """``rename_dir_into_place`` where a directory may be at ``path`` already: it is first moved to ``aside/NAME``
    (``aside``: an empty directory beside ``path`` that the caller made, and removes once this returns), then
    ``tmp`` is renamed to ``path``; ``pause_name``: a ``pause_point`` between the two renames (crash tests). A crash
    between them leaves no ``path`` and the previous directory whole under ``aside``, for the caller to move back."""
    path = Path(path)
    fsync_tree(Path(tmp))
    if path.is_dir() and not path.is_symlink():
        os.rename(path, Path(aside) / path.name)
        if pause_name:
            pause_point(pause_name)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def whole_lines(path: Path) -> bytes:
    """An append log's content up to its last newline; a cut last line (a crash while it was written) is cut off
    the file too, so the next line appended starts a line of its own. ``b""`` when there is no file."""
    path = Path(path)
    if not path.exists():
        return b""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return data[:keep]


def open_appending(path: Path, encoding: str = "utf-8"):
    """``path`` opened for appending text, created if missing, its name made durable (the directory fsynced)
    before anything is written: an append log. Lines written are durable once ``sync`` returns."""
    path = Path(path)
    f = open(path, "a", encoding=encoding)
    try:
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        raise
    return f


def sync(f) -> None:
    """Flush the open file ``f`` (``open_appending``) and fsync it: what was written to it is on the disk."""
    f.flush()
    os.fsync(f.fileno())


def write_unnamed(directory: Path, data) -> int:
    """Write ``data`` (as ``atomic_write`` does) into a new file of ``directory`` that has no name yet (Linux
    ``O_TMPFILE``), fsync it, and return its descriptor for ``publish``. Until then the file is in no directory:
    a crash leaves nothing behind, so such files can be written ahead, several at once."""
    fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o666)  # the umask decides
    try:
        _write_buffers(fd, _byte_views(data))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link(fd: int, path: Path) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (linkat with AT_SYMLINK_FOLLOW on /proc/self/fd; the
    directory descriptor makes os.link call linkat rather than link, which would not follow the link)."""
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)


def publish(fd: int, path: Path, pause_name: str | None = None) -> None:
    """Name a file written by ``write_unnamed`` the way ``atomic_write`` finishes: linked under the temporary
    name, ``pause_name`` (a ``pause_point``), renamed over ``path``, the directory fsynced. So the directory goes
    through the same states as with ``atomic_write``. The caller closes ``fd``."""
    path = Path(path)
    tmp = _temporary(path)
    tmp.unlink(missing_ok=True)  # a leftover of a killed run
    try:
        _link(fd, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _rename_into_place(tmp, path, pause_name)


def unnamed_files_work(probe: Path) -> bool:
    """Whether ``write_unnamed`` and ``publish`` work in ``probe``'s directory (they need Linux, a file system
    with O_TMPFILE, and /proc); tried with an empty file briefly named ``probe``."""
    if not hasattr(os, "O_TMPFILE"):
        return False
    try:
        fd = write_unnamed(probe.parent, b"")
    except OSError:
        return False
    try:
        _link(fd, probe)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
