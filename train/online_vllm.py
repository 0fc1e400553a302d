"""Online training with the target in a vLLM engine (``target_engine=vllm``): the training GPU holds the drafter,
the target runs in a vLLM engine started by this same process and spread over ``target_tensor_parallel_size``
GPUs, and every micro-batch's features come from it.

For a target that does not fit next to the drafter on the training GPU, or a hybrid one whose Hugging Face forward
lacks its fused kernels (a target that fits trains faster in-process: train/online.py). One process:
    dflashkit train --recipe recipes/qwen3.6-27b.yaml --target /models/Qwen3.6-27B --data chats.jsonl \\
        --target-engine vllm --tensor-parallel-size 2 --gpu-memory-utilization 0.6

Design choices:
- The capture is extraction's (targets/vllm/capture.py ``VllmCapture``: the ``extract_hidden_states`` method, one
  file per request, read with safetensors, checked against its prompt); the plan, the batches (``plan`` and
  ``target_batch_tokens``) and the sample dicts are online training's: ``VllmOnlineFeatures`` is
  ``OnlineFeatures`` with another ``open_capture`` and ``run_target``. So the samples (``encode_data``), anchors,
  losses, held-out split, checkpoints, export and resume are those of the Hugging Face path.
- The target is only described (config, tokenizer, identity: ``describe_target``); its weights live in vLLM's
  workers. The training head (embedding, final norm, lm_head) is read alone on the training device
  (``load_target_head``), as when training on shards.
- vLLM takes the last layer before the final norm and cannot give the final-norm output: a tap on layer L-1 is
  refused here (targets/vllm/capture.py ``check_taps``, as extract), ``loss=kl``
  and ``labels=target_argmax`` by train/config.py, before anything loads.
- One training process: several would each start an engine on the same GPUs. The engine starts when the dataset
  is entered, before the drafter moves to the GPU (vLLM profiles the memory it may take at start), and shuts down
  when the trainer's ExitStack closes, however the run ends. ``target_gpu_memory_utilization`` is its share of
  each GPU; what it leaves on the first GPU is the drafter's training memory.
- The engine accepts prompts of up to ``max_length`` tokens (+1, the token it samples): its KV cache is sized for
  the training sequences, not for the target's whole context.
- ``vllm_api``: the installed vLLM unless the caller gives one (targets/vllm/api.py ``load_api``; tests give the
  CPU twin, tests/support/vllm_capture_standin.py); vLLM is imported only when this engine runs, and a missing one
  is one line naming the extra before the data or the target load.
"""

from __future__ import annotations

import time

import torch

from dflashkit.errors import UserError

from .online import (
    FEATURE_DTYPE,
    OnlineFeatures,
    check_online_inputs,
    encode_online_data,
    live_manifest,
    target_dtype,
)

ONE_PROCESS = ("target_engine=vllm trains in one process: vLLM spreads the target over target_tensor_parallel_size "
               "GPUs itself; launch one process (python -m dflashkit.train, or accelerate launch --num_processes 1)")


def engine_api(cfg, vllm_api, world: int):
    """The vLLM calls of a ``target_engine=vllm`` run: ``vllm_api``, else the installed vLLM (UserError naming the
    extra when it is missing); None for any other run. Refuses several training processes."""
    if cfg.target_engine != "vllm":
        return None
    if world > 1:
        raise UserError(f"{ONE_PROCESS}; {world} were launched")
    from dflashkit.targets.vllm.api import load_api

    return load_api(vllm_api, settle=False)


def open_online_vllm(cfg, device, compute_dtype: torch.dtype, say=print, rank: int = 0, parts: dict | None = None):
    """Describe ``cfg.target`` (no weights) and encode ``cfg.data``: (target description, head, live manifest,
    samples), as ``online.open_online`` returns them, with its ``parts``."""
    from dflashkit.targets.loading import load_target_head
    from dflashkit.targets.vllm.capture import describe_target

    check_online_inputs(cfg)
    loading = time.perf_counter()
    target = describe_target(cfg.target)
    head = load_target_head(cfg.target, dtype=compute_dtype, device=device)
    return target, head, live_manifest(cfg, target), encode_online_data(cfg, target.tokenizer, say, rank, parts,
                                                                        loading)


def capture_config(cfg, device):
    """The engine's settings (targets/vllm/capture.py ``VllmCaptureConfig``) for the run ``cfg``."""
    from dflashkit.targets.vllm.capture import VllmCaptureConfig

    return VllmCaptureConfig(tensor_parallel_size=cfg.target_tensor_parallel_size,
                             gpu_memory_utilization=cfg.target_gpu_memory_utilization,
                             max_model_len=cfg.max_length + 1,
                             dtype=str(target_dtype(cfg, device)).removeprefix("torch."))


class VllmOnlineFeatures(OnlineFeatures):
    """``OnlineFeatures`` whose target runs in a vLLM engine: started on entering the dataset, shut down (and its
    files removed) on leaving it. Never carries ``last_hidden``."""

    def __init__(self, target, samples: list, target_layer_ids, *, config, api, batch_tokens: int, device):
        from dflashkit.targets.vllm.capture import check_taps

        check_taps(target_layer_ids, target.num_layers, False, "target_engine=vllm", "train with target_engine=hf")
        self.config, self.api = config, api  # read by open_capture, during OnlineFeatures.__init__
        super().__init__(target, samples, target_layer_ids, store_last_hidden=False, batch_tokens=batch_tokens,
                         device=device)

    def open_capture(self, target_layer_ids: list[int]):
        from dflashkit.targets.vllm.capture import VllmCapture

        return VllmCapture(self.target.model_dir, target_layer_ids, self.config, self.api)

    def run_target(self, todo: list) -> tuple[list[torch.Tensor], None]:
        """One vLLM request per sample (no padding): its taps concatenated on the feature axis, [T, K*H] in
        FEATURE_DTYPE on the device."""
        per_sample = self.capture([s.input_ids.tolist() for s in todo])
        return [torch.cat(taps, dim=-1).to(device=self.device, dtype=FEATURE_DTYPE) for taps in per_sample], None
