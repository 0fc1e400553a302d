"""The vLLM calls dflashkit makes, in one object (``VllmApi``), chosen once per run by ``load_api``: the
installed vLLM, or what a caller passes instead (the tests' CPU twins of vllm.LLM, tests/support/); and the
engine's start and shutdown that every path shares.

Every path that runs vLLM (`eval --engine vllm`, `extract --engine vllm`, `train --target-engine vllm`, the
benchmark bench/bench_vllm.py) holds a ``VllmApi`` and calls vLLM only through it, so the same code, file
reading and counter reading included, runs over a twin on a CPU.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import Callable

from .runtime import import_vllm, release_gpu, wait_for_gpu_memory_to_settle


@dataclass
class VllmApi:
    llm_factory: Callable  # LLM(model=..., **engine kwargs) -> an object with generate() (and get_metrics())
    sampling_params: Callable  # SamplingParams(max_tokens=..., temperature=..., stop_token_ids=..., ignore_eos=...)
    clock: Callable[[], float] = time.perf_counter  # what times the waves of a served run
    release: Callable[[], None] = lambda: None  # after an engine is dropped: free what it held (GPU memory)
    version: str = "stand-in"  # reported (eval's report, the shards' manifest)


def installed_api(settle: bool = True) -> VllmApi:
    """The installed vLLM; UserError naming the extra when it is missing. ``settle``: after an engine is released,
    wait until the GPU's memory stops falling (for the next engine's start-up profiling; runtime.release_gpu)."""
    vllm = import_vllm()
    return VllmApi(vllm.LLM, vllm.SamplingParams, time.perf_counter, lambda: release_gpu(settle=settle),
                   vllm.__version__)


def load_api(given: VllmApi | None = None, settle: bool = True) -> VllmApi:
    """The vLLM calls of one run: ``given`` (a caller's, e.g. a test's CPU twin), else the installed vLLM."""
    return given if given is not None else installed_api(settle)


def start_engine(api: VllmApi, **kwargs):
    """api.llm_factory(**kwargs), once more after the GPU settles if the engine core failed to start: seen on an
    H200, the engine before it was still freeing memory while this one profiled (vllm/v1/worker/gpu_worker.py
    asserts that free memory did not grow during its start-up profiling). The first try waits for the GPU to
    settle too: a process that ran on it just before may still be freeing its memory."""
    wait_for_gpu_memory_to_settle()
    try:
        return api.llm_factory(**engine_arguments(kwargs))
    except RuntimeError as error:
        if "initialization failed" not in str(error):
            raise
        api.release()
        return api.llm_factory(**engine_arguments(kwargs))


def engine_arguments(kwargs: dict) -> dict:
    """The engine arguments with a copy of ``speculative_config``: vLLM adds its ``ModelConfig`` and
    ``ParallelConfig`` objects to the dict it is given (vllm/engine/arg_utils.py ``create_speculative_config``),
    which would leave the caller's record of the configuration unwritable as JSON and a retry starting from a
    mutated dict."""
    spec = kwargs.get("speculative_config")
    return kwargs if spec is None else kwargs | {"speculative_config": copy.deepcopy(spec)}


def shutdown_core(llm) -> None:
    """vLLM's own shutdown of an engine's core (a child process holding GPU memory); nothing for a twin without
    one."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def close_engine(llm, api: VllmApi) -> None:
    """vLLM's own shutdown of the engine core, then drop it and free the GPU before another engine starts."""
    shutdown_core(llm)
    del llm
    gc.collect()
    api.release()
