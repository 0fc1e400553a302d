"""What every static step of the runtime shares (the slot generator's decode step, the verifier's steps and
compaction, the drafter's pass): capturing a step as a CUDA graph, and staging the host's small inputs.

Design choices:
- A step is a function of static buffers. On CUDA it is captured once (two warm-up calls on a side stream for the
  allocator, kernels and lazy initialisation, then the captured call) and replayed; on the CPU, or with CUDA
  graphs off, the same function runs eagerly: one code path, so the CPU tests cover what the GPU replays. Steps
  that replay one after another may share a memory pool (``pool``); a step whose outputs must outlive the next
  one's temporaries gets its own.
- Inputs that only the host knows (a tree's tokens and parents, the nodes a round keeps) are written into a
  pinned host buffer and copied to the device without waiting (`Staging`); an event keeps the host from
  rewriting the buffer before that copy has run. On the CPU the host buffer is the device buffer: no copy.
"""

from __future__ import annotations

import torch


def capture_graph(compute, device, pool):
    """``compute`` (a function of static buffers) captured once as a CUDA graph: two warm-up calls on a side
    stream (allocator, kernels, lazy init), then one captured call. Returns (graph, the captured outputs), which
    ``graph.replay()`` recomputes in place."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                compute()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = compute()
    return graph, outputs


class Staging:
    """A small input buffer on `device` (`buffer`) that the host fills through `write()` and `send()`."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.buffer = torch.zeros(size, dtype=dtype, device=device)
        self.on_gpu = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=True) if self.on_gpu else self.buffer
        self.copied = torch.cuda.Event() if self.on_gpu else None

    def write(self) -> torch.Tensor:
        """The host buffer, once the previous copy from it has run (at once in a decode loop, which has read a
        result of the device since)."""
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()
        return self.host

    def send(self) -> None:
        if self.on_gpu:
            self.buffer.copy_(self.host, non_blocking=True)
            self.copied.record()
