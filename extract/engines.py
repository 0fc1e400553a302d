"""Who runs the target for ``dflashkit extract`` (--engine), chosen once at the start of a run.

An engine is what differs between the two ways of capturing features; the run (extract/run.py) asks it and never
asks which one it holds:
- ``check_launch``: whether this launch suits it (vLLM spreads the target itself: one process, no --device-map);
- ``load_target``: the target, loaded in this process (``hf``) or only described (``vllm``: its weights live in
  vLLM's workers);
- ``check_taps``: what it cannot capture as Hugging Face does (vLLM: the last layer, the final-norm output);
- ``record``: the manifest's ``engine`` (a resumed run must have the same);
- ``features``: open for the run, a callable from a batch of samples to their features packed to real tokens
  (hidden [sum T, K*H], last_hidden [sum T, H] or None).
"""

from __future__ import annotations

import contextlib
import functools

from dflashkit.errors import UserError
from dflashkit.extract.data import batching
from dflashkit.extract.options import ENGINES, ExtractOptions


def engine_for(opts: ExtractOptions, vllm_api=None) -> HfEngine | VllmEngine:
    """The engine ``opts.engine`` names. ``vllm_api``: the vLLM calls for --engine vllm (targets/vllm/api.py
    ``VllmApi``; None: the installed vLLM, a UserError naming the extra when it is missing)."""
    if opts.engine not in ENGINES:
        raise UserError(f"--engine {opts.engine!r}: choose one of {', '.join(ENGINES)}")
    if opts.engine == "hf":
        return HfEngine(opts)
    from dflashkit.targets.vllm.api import load_api

    return VllmEngine(opts, load_api(vllm_api, settle=False))


class HfEngine:
    """--engine hf: the target in this process, its layers hooked (targets/capture.py ``LayerCapture``), one
    right-padded forward per batch."""

    name = "hf"

    def __init__(self, opts: ExtractOptions):
        self.opts = opts

    def check_launch(self, world: int) -> None:
        """Any launch: each rank loads its own copy (or one process spreads it, --device-map)."""

    def load_target(self, torch_dtype, device):
        from dflashkit.targets.loading import load_target

        return load_target(self.opts.target, dtype=torch_dtype, device=device, device_map=self.opts.device_map,
                           trust_remote_code=self.opts.trust_remote_code)

    def check_taps(self, layer_ids: list[int], num_layers: int) -> None:
        """Every layer and the final-norm output can be captured."""

    def record(self) -> dict:
        return {"name": self.name}

    @contextlib.contextmanager
    def features(self, target, layer_ids: list[int], device, torch_dtype):
        from dflashkit.targets.capture import LayerCapture

        with LayerCapture(target, layer_ids, store_last_hidden=self.opts.store_last_hidden) as capture:
            yield functools.partial(_hf_batch_features, capture, device)


class VllmEngine:
    """--engine vllm: a vLLM engine with tensor parallelism (targets/vllm/capture.py: one process, the taps
    captured during prefill, one ``generate`` per planned batch)."""

    name = "vllm"

    def __init__(self, opts: ExtractOptions, api):
        self.opts, self.api = opts, api
        # the VllmCaptureConfig fields the run sets (the dtype is the run's, known once the launch is joined)
        self.config = {"tensor_parallel_size": opts.tensor_parallel_size,
                       "gpu_memory_utilization": opts.gpu_memory_utilization,
                       "max_model_len": opts.max_model_len or (opts.max_length + 1 if opts.max_length else None),
                       "max_num_seqs": opts.max_batch_size, "trust_remote_code": opts.trust_remote_code}

    def check_launch(self, world: int) -> None:
        if world > 1 or self.opts.device_map:
            raise UserError("--engine vllm runs in one process: vLLM spreads the target over "
                            "--tensor-parallel-size GPUs itself; launch one process without --device-map")

    def load_target(self, torch_dtype, device):
        from dflashkit.targets.vllm.capture import describe_target

        return describe_target(self.opts.target, trust_remote_code=self.opts.trust_remote_code)

    def check_taps(self, layer_ids: list[int], num_layers: int) -> None:
        from dflashkit.targets.vllm.capture import check_taps

        check_taps(layer_ids, num_layers, self.opts.store_last_hidden)

    def record(self) -> dict:
        return {"name": self.name, "version": self.api.version,
                "tensor_parallel_size": self.config["tensor_parallel_size"]}

    @contextlib.contextmanager
    def features(self, target, layer_ids: list[int], device, torch_dtype):
        from dflashkit.targets.vllm.capture import VllmCapture, VllmCaptureConfig

        config = VllmCaptureConfig(dtype=str(torch_dtype).removeprefix("torch."), **self.config)
        with VllmCapture(target.model_dir, layer_ids, config, self.api) as capture:
            yield functools.partial(_vllm_batch_features, capture)


def _hf_batch_features(capture, device, todo: list):
    """One right-padded forward batch through the hooked target, gathered to its real tokens."""
    ids, _ = batching.pad_batch(todo, device)
    hidden, last_hidden = capture(ids)  # right padding: no mask needed (pad_batch)
    keep = batching.real_token_index([len(s.input_ids) for s in todo], ids.shape[1], hidden.device)
    return (hidden.flatten(0, 1).index_select(0, keep),
            last_hidden.flatten(0, 1).index_select(0, keep) if last_hidden is not None else None)


def _vllm_batch_features(capture, todo: list):
    """One batch as vLLM requests: each sample's taps concatenated on the feature axis, the samples in order."""
    import torch

    per_sample = capture([s.input_ids for s in todo])
    return torch.cat([torch.cat(taps, dim=-1) for taps in per_sample]), None
