"""Which paths a piece of code makes durable: ``os.fsync`` wrapped to record the path of each descriptor it is
given (read from /proc/self/fd, so Linux only), in order, before the real fsync runs."""

import os
from pathlib import Path


class FsyncLog:
    """The paths fsynced while installed (``record_fsyncs``), in call order."""

    def __init__(self, fsync):
        self.paths: list[Path] = []
        self._fsync = fsync

    def __call__(self, fd: int) -> None:
        self.paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        self._fsync(fd)

    def names(self) -> set[str]:
        return {p.name for p in self.paths}


def record_fsyncs(monkeypatch) -> FsyncLog:
    """Install an ``FsyncLog`` as ``os.fsync`` for the rest of the test."""
    log = FsyncLog(os.fsync)
    monkeypatch.setattr(os, "fsync", log)
    return log
