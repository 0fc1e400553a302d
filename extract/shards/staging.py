"""Host staging buffers: features wait in them, between the copy from the device and their shard's write to disk.

Pinned for copies from a GPU (so the copy runs asynchronously on a side stream), reused from shard to shard, and
bounded, so the forward waits for the disk only when all of them are full.
"""

from __future__ import annotations

import threading
import time

import torch


class StagingPool:
    """Host buffers (pinned for device copies) that features wait in until their shard is on disk; reused.

    ``take`` waits while the buffers in use, not counting those of the shard still being collected
    (``collecting``), would exceed ``limit`` bytes. Those are not counted because only more batches can complete
    that shard and free them; a single batch larger than the limit is still served when nothing else is in use.
    Capacities are powers of two, so buffers fit again as batch sizes vary."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self._in_use = 0  # bytes handed out
        self._collecting = 0  # bytes of those held by the shard being collected
        self._cv = threading.Condition()
        self.wait_seconds = 0.0  # time callers spent waiting in ``take`` (the forward waiting on the disk)

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``; waits for ``give`` when the limit is reached."""
        capacity = 1 << max(nbytes - 1, 0).bit_length()
        with self._cv:
            started = time.perf_counter()
            while True:
                fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() == pin]
                counted = self._in_use - self._collecting
                if fits or counted + capacity <= self.limit or counted == 0:
                    break
                self._cv.wait()
            self.wait_seconds += time.perf_counter() - started
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not buf]  # by identity: == compares elements
            else:
                while self._free and self._in_use + sum(b.numel() for b in self._free) + capacity > self.limit:
                    self._free.pop(0)  # make room: memory held idle counts against the limit too
                buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
            self._in_use += buf.numel()
            return buf

    def give(self, buffers) -> None:
        with self._cv:
            for buf in buffers:
                self._in_use -= buf.numel()
                self._free.append(buf)
            self._cv.notify_all()

    def set_collecting(self, nbytes: int) -> None:
        with self._cv:
            self._collecting = nbytes
            self._cv.notify_all()
