"""A CPU twin of `vllm.LLM` configured for hidden-state capture: the calls and files `extract --engine vllm` uses.

vLLM does not run on a CPU, so the capture adapter (targets/vllm/capture.py) runs in tests (and the lab's CPU toys)
over this twin; the GPU run proves the real path. A test double: nothing of the product imports it.

Design choices:
- ``LLM(model=DIR, speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}, kv_transfer_config={
  "kv_connector": "ExampleHiddenStatesConnector", "kv_role": ..., "kv_connector_extra_config":
  {"shared_storage_path": DIR}})``: the settings the real engine needs, checked as vLLM 0.24 checks them (the
  method, one speculative token, the aux ids, a connector role); anything else is refused, so a misconfigured
  adapter fails here as it would there.
- The target loads with dflashkit's loader (``dtype`` "auto" is float32 on the CPU) and the features come from
  dflashkit's own capture (targets/capture.py ``LayerCapture``): aux id ``a`` is target layer ``a - 1``. Aux
  id 0 (the embeddings) and ``L`` (the last layer, which vLLM takes before the final norm where LayerCapture
  takes it after) are not modelled and refused.
- ``generate`` runs each prompt alone (a vLLM request sees only its own tokens) and writes, per request, what
  the connector writes: ``<storage>/<request id>.safetensors`` with ``hidden_states`` ``[T, K, H]`` (the aux
  layers in layer order) and ``token_ids`` ``[T]`` (the prompt), next to an empty ``.lock`` file; the path comes
  back in ``RequestOutput.kv_transfer_params["hidden_states_path"]``. Request ids count up per engine, as vLLM's
  do, so two engines on one directory would collide there as well.
- The one sampled token of each request is not modelled (its output holds no tokens): the adapter reads none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

ENGINE_KEYS = {"model", "tensor_parallel_size", "gpu_memory_utilization", "dtype", "max_num_seqs",
               "trust_remote_code", "enable_prefix_caching", "speculative_config", "kv_transfer_config",
               "max_model_len"}  # the LLM(...) arguments this twin understands


@dataclass
class SamplingParams:  # the fields of vllm.SamplingParams the adapter sets
    max_tokens: int = 16
    temperature: float = 1.0


# the twins of vllm.outputs, shared with the serving twin (vllm_standin.py)
@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:  # the fields of vllm.outputs.RequestOutput the adapters read
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    kv_transfer_params: dict | None = field(default=None)  # the capture connector's file (hidden_states_path)
    metrics: object | None = None  # the serving twin's RequestStateStats
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


def _aux_ids(speculative_config: dict) -> list[int]:
    if (speculative_config or {}).get("method") != "extract_hidden_states":
        raise ValueError(f"this twin models only the extract_hidden_states method, got {speculative_config!r}")
    if speculative_config.get("num_speculative_tokens") != 1:
        raise ValueError("extract_hidden_states needs num_speculative_tokens == 1")  # v1/spec_decode/...:35
    hf_config = speculative_config.get("draft_model_config", {}).get("hf_config", {})
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("eagle_aux_hidden_state_layer_ids must be set in the draft model config for "
                         "extract_hidden_states method")
    return sorted(int(a) for a in ids)  # collected while looping over the layers: layer order


def _storage(kv_transfer_config: dict) -> str:
    config = kv_transfer_config or {}
    if config.get("kv_connector") != "ExampleHiddenStatesConnector":
        raise ValueError(f"this twin models only the ExampleHiddenStatesConnector, got {config!r}")
    if config.get("kv_role") not in ("kv_producer", "kv_both"):
        raise ValueError(f"kv_role {config.get('kv_role')!r}: the connector writes, so it produces")
    return (config.get("kv_connector_extra_config") or {}).get("shared_storage_path", "/tmp")


class LLM:
    """``vllm.LLM`` as `extract --engine vllm` uses it, on the CPU."""

    def __init__(self, model: str, speculative_config: dict | None = None, kv_transfer_config: dict | None = None,
                 dtype: str = "auto", trust_remote_code: bool = False, **engine_kwargs):
        from dflashkit.targets.loading import load_target

        unknown = set(engine_kwargs) - ENGINE_KEYS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        self.engine_kwargs = dict(engine_kwargs)
        self.aux_ids = _aux_ids(speculative_config)
        self.storage = _storage(kv_transfer_config)
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        self.target = load_target(model, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        bad = [a for a in self.aux_ids if not 1 <= a < self.target.num_layers]
        if bad:
            raise NotImplementedError(f"aux ids {bad}: only 1..L-1 (target layers 0..L-2) are modelled; 0 is the "
                                      "embeddings and L the last layer before the final norm")
        self.llm_engine = None  # nothing to shut down
        self._next_id = 0

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        return [self._request([int(t) for t in p["prompt_token_ids"]]) for p in prompts]

    def _request(self, token_ids: list[int]) -> RequestOutput:
        from safetensors.torch import save_file

        from dflashkit.targets.capture import LayerCapture

        request_id = str(self._next_id)
        self._next_id += 1
        layer_ids = [a - 1 for a in self.aux_ids]
        with LayerCapture(self.target, layer_ids) as capture:
            hidden, _ = capture(torch.tensor([token_ids]))
        stacked = hidden[0].unflatten(-1, (len(layer_ids), -1))  # [T, K*H] -> [T, K, H]
        path = os.path.join(self.storage, f"{request_id}.safetensors")
        os.makedirs(self.storage, exist_ok=True)
        open(path + ".lock", "w").close()
        save_file({"hidden_states": stacked.contiguous(), "token_ids": torch.tensor(token_ids)}, path)
        return RequestOutput(request_id, token_ids, [CompletionOutput(0, "", [], "length")],
                             kv_transfer_params={"hidden_states_path": path})


def standin_api():
    """The VllmApi of `extract --engine vllm` and `train --target-engine vllm` over this twin."""
    from dflashkit.targets.vllm.api import VllmApi

    return VllmApi(LLM, SamplingParams)
