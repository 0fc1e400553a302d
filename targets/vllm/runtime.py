"""What every dflashkit path that runs vLLM shares (`eval --engine vllm`, `extract --engine vllm`, `train
--target-engine vllm`): importing it, or one line naming the extra, giving the GPU back after an engine, and
choosing vLLM's V1 model runner for one engine (``model_runner``: `eval --engine vllm --baseline v1`).

vLLM is imported only here, only when called (by api.load_api): the rest of the package runs without it.
"""

from __future__ import annotations

import contextlib
import os
import time

from dflashkit.errors import UserError

MISSING_VLLM = "--engine vllm needs vLLM: pip install 'dflashkit[vllm]'"


def import_vllm():
    """The installed vllm module; UserError naming the extra when it is missing."""
    try:
        import vllm
    except ImportError:
        raise UserError(MISSING_VLLM) from None
    return vllm


def release_gpu(settle: bool = True) -> None:
    """After an engine was shut down and dropped: vLLM's own cleanup, the CUDA cache emptied, and (``settle``)
    a wait until the GPU's memory stops falling, for the next engine's start-up profiling."""
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if settle:
        wait_for_gpu_memory_to_settle()


def wait_for_gpu_memory_to_settle(limit_s: float = 60.0) -> None:
    """Until the GPU's used memory stops falling (nvidia-smi, read once a second): the engine core of the engine
    just shut down is another process, and the next engine's start-up profiling refuses to run while memory is
    being freed (vllm/v1/worker/gpu_worker.py). Without nvidia-smi it returns at once."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    readings, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline:
        used = sum(int(x) for x in subprocess.run(query, capture_output=True, text=True).stdout.split() if x.isdigit())
        readings.append(used)
        if len(readings) >= 5 and max(readings[-5:]) - min(readings[-5:]) < 16:  # MiB, steady for 4 s
            return
        time.sleep(1.0)


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@contextlib.contextmanager
def model_runner(v1: bool):
    """With ``v1``, vLLM's V1 model runner for the engine started inside (VLLM_USE_V2_MODEL_RUNNER=0, read when
    the engine's config is built: vllm/config/vllm.py:522-525); the variable as it was afterwards."""
    before = os.environ.get(V2_RUNNER_ENV)
    if v1:
        os.environ[V2_RUNNER_ENV] = "0"
    try:
        yield
    finally:
        if v1:
            if before is None:
                os.environ.pop(V2_RUNNER_ENV, None)
            else:
                os.environ[V2_RUNNER_ENV] = before
