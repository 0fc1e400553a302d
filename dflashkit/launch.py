"""Launch: who this process is in a launch, which device and dtype it computes in, and the process group.

Every command and benchmark script that may run under ``torchrun`` starts here instead of reading the launcher's
environment itself (the trainer is the exception: accelerate does this for it).

Design choices:
- Rank, world size and local rank come from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  set by torchrun and ``accelerate launch``); a process started alone is rank 0 of 1. A value that is not a whole
  number, or a rank outside the world, is the user's to fix and stops with one line naming the variable.
- The local device is the user's ``--device`` when given (a bare ``cuda`` means this rank's GPU); else
  ``cuda:LOCAL_RANK`` when CUDA is available; else the CPU. The default dtype is bf16 on a GPU and fp32 on the CPU
  (the CPU has no fast bf16 matmul, and fp32 keeps the tests' numbers exact).
- The process group is joined only when there are several processes: NCCL when the collectives move tensors on a
  GPU, gloo when they move CPU tensors or only wait for each other (a barrier). ONE timeout, ``GROUP_TIMEOUT``
  (24 h), for every group: the longest any caller waits inside one collective is regeneration's last barrier,
  where the ranks that finished their share wait for the slowest rank's generation (hours on a large data set).
  A shorter timeout would kill healthy runs; a rank that dies is caught by the launcher, which ends the others,
  so the timeout only bounds a true hang.

This module imports nothing of the project but ``errors``, so every package may use it.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch

from .errors import UserError

GROUP_TIMEOUT = datetime.timedelta(hours=24)  # every process group's collective timeout (see the module docstring)
_DTYPES = ("bfloat16", "float16", "float32")  # the dtypes a user may name


class Ranks(NamedTuple):
    """This process's place in the launch."""

    rank: int  # 0 .. world_size - 1 over every process of the launch
    world_size: int  # processes in the launch; 1 when started alone
    local_rank: int  # index among the processes of this host: the GPU it uses


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    if not text.strip():  # unset or empty: started alone
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"environment variable {name}={text!r} is not a whole number >= 0; unset it, or start the "
                        f"command through torchrun / accelerate launch, which set it")
    return value


def ranks() -> Ranks:
    """(rank, world_size, local_rank) from the launcher's environment; (0, 1, 0) when started alone."""
    world = max(_env_int("WORLD_SIZE", 1), 1)
    rank = _env_int("RANK", 0)
    if rank >= world:
        raise UserError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}; unset both, or start "
                        f"the command through torchrun / accelerate launch, which set them")
    return Ranks(rank, world, _env_int("LOCAL_RANK", 0))


def local_device(device: str | torch.device | None = None) -> torch.device:
    """The device this process computes on: ``device`` as given (a bare ``cuda``: ``cuda:LOCAL_RANK``), else
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if device and str(device) != "cuda":
        return torch.device(device)
    if not device and not torch.cuda.is_available():  # None or "": the default
        return torch.device("cpu")
    return torch.device("cuda", ranks().local_rank)


def default_dtype(device: str | torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """``dtype`` as given (a name such as ``bfloat16``, or a torch dtype), else bf16 on a GPU and fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not dtype:  # None or "": the default
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def join_process_group(device: str | torch.device) -> bool:
    """Join the launch's process group when there are several processes (a no-op alone, or when joined already);
    whether a group is live. ``device``: where the collectives' tensors live: NCCL for a GPU (made this process's
    current device), gloo for the CPU (also right for a group that only waits at barriers)."""
    import torch.distributed as dist

    if ranks().world_size == 1:
        return False
    if not dist.is_initialized():
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    return True


def barrier() -> None:
    """Wait for every process of the launch (a no-op without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def leave_process_group() -> None:
    """Leave the process group joined by ``join_process_group`` (a no-op when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
