"""The target's tapped-layer features captured by vLLM during prefill (`dflashkit extract --engine vllm`).

For a target too large for one GPU, or a hybrid one whose Hugging Face forward lacks its fused kernels: vLLM runs
it with tensor parallelism and hands back, per prompt, the outputs of the tapped layers. The extraction run
(extract/run.py) renders, batches, masks and writes shards exactly as with Hugging Face capture.

One GPU:
    dflashkit extract --engine vllm --target /models/Qwen3-8B --data chats.jsonl --out runs/q3
Several GPUs (one process; vLLM spreads the target over them, one TP rank writes the features):
    dflashkit extract --engine vllm --tensor-parallel-size 8 --target /models/Llama-3.3-70B --data chats.jsonl \\
        --out runs/llama70b --max-length 4096 --gpu-memory-utilization 0.85

What vLLM 0.24 does (paths in the wheel's vllm/):
- The speculative method ``extract_hidden_states`` (config/speculative.py:615-616, 680-706) replaces the drafter
  by a model that only writes the target's aux hidden states into a KV-cache-shaped buffer
  (model_executor/models/extract_hidden_states.py:336-387, v1/spec_decode/extract_hidden_states.py:86-167);
  ``num_speculative_tokens`` must be 1 (:35). The layers are ``eagle_aux_hidden_state_layer_ids`` of
  ``speculative_config["draft_model_config"]["hf_config"]`` (config/speculative.py:691-704; read at
  v1/spec_decode/extract_hidden_states.py:67 and v1/worker/gpu_model_runner.py:5369). It runs on the V1 model
  runner (config/vllm.py:2031-2032 keeps the V2 runner for eagle/eagle3/mtp/dflash).
- Aux id ``a`` is ``hidden + residual`` after decoder layer ``a - 1`` (id 0: the embeddings), collected in layer
  order (model_executor/models/llama.py:411-420, qwen2.py:407-414, models/interfaces.py:1328-1337), and taken
  before the final norm (llama.py:427). So target layer ``i`` is aux id ``i + 1`` (``aux_layer_ids``); for
  ``i = L - 1`` that is the un-normed output where dflashkit reads the final-norm output
  (drafter/vllm_rules.py VLLM_RULES "last_layer_tap", 0.24 and 0.26 alike), so that tap is refused, as is
  --store-last-hidden.
- ``kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
  "kv_connector_extra_config": {"shared_storage_path": DIR}}``: when a request finishes, TP rank 0 alone
  (distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:161-163, 254, 316-317) writes
  ``DIR/<request id>.safetensors`` (:444-446) with ``hidden_states`` ``[T, K, H]`` (the model dtype, the K aux
  layers in layer order) and ``token_ids`` ``[T]``: the prompt's tokens (:363-366, 482-488; T is the prompt
  length, :330). The write is asynchronous: the path comes back in ``RequestOutput.kv_transfer_params
  ["hidden_states_path"]`` (:501) while a writer thread may still hold an exclusive flock on ``<path>.lock``
  (:238-241, 290-295); a reader takes a shared flock on it first (:45-62).

Design choices:
- vLLM is the optional extra (`pip install 'dflashkit[vllm]'`), imported only by ``api.load_api`` and only when
  this engine runs; without it the command fails in one line (``MISSING_VLLM``). Everything vLLM-specific is in
  ``api.VllmApi`` (the LLM factory, SamplingParams, the GPU release), so tests pass the CPU twin
  (tests/support/vllm_capture_standin.py) and the same code, file reading included, runs.
- One ``generate`` per forward batch of the run (max_tokens 1: prefill plus one sampled token), prompts given as
  token ids, outputs in prompt order. Each file is read with safetensors only (never pickle), checked against
  its prompt (token ids, length, K, H), then deleted with its lock file.
- Prefix caching is off: every token's state is computed within its own request, so a file never depends on
  what ran before it.
- The files go to a fresh temporary directory (``$TMPDIR``; ``storage_dir`` to choose, e.g. /dev/shm), removed
  when the engine closes. A batch's files hold its tokens x K x H values once (bf16: ~400 MB at 16k tokens,
  three taps of an 8B target).
- The target's description (identity, tokenizer, sizes) is read from its directory without loading weights
  (``describe_target``): the weights live only in vLLM's workers.
"""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import UserError

from .api import VllmApi, shutdown_core

METHOD = "extract_hidden_states"  # vLLM's speculative method that only captures (config/speculative.py:58)
CONNECTOR = "ExampleHiddenStatesConnector"  # the KV connector that writes one safetensors file per request
PATH_PARAM = "hidden_states_path"  # RequestOutput.kv_transfer_params key of a request's file
HIDDEN_KEY, TOKENS_KEY = "hidden_states", "token_ids"  # the tensors of a request's file


@dataclass
class VllmCaptureConfig:
    tensor_parallel_size: int = 1  # GPUs one engine spreads the target over (one process)
    gpu_memory_utilization: float = 0.9  # share of each GPU's memory vLLM may take (weights + cache)
    max_model_len: int | None = None  # longest prompt the engine accepts (None: the target's own limit)
    dtype: str = "auto"  # the target's dtype in vLLM; the features come back in it
    max_num_seqs: int = 64  # requests in one engine step (the run passes --max-batch-size)
    trust_remote_code: bool = False  # run the target's own modeling code
    storage_dir: str | None = None  # where the connector writes the per-request files (None: a temporary dir)

    def check(self) -> None:
        if self.tensor_parallel_size < 1:
            raise UserError(f"--tensor-parallel-size {self.tensor_parallel_size}: use 1 or more GPUs")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: use a share in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"--max-model-len {self.max_model_len}: use at least 2 tokens")


def aux_layer_ids(target_layer_ids) -> list[int]:
    """vLLM's aux hidden-state ids for dflashkit's target_layer_ids: layer i's output is aux id i + 1."""
    return [int(i) + 1 for i in target_layer_ids]


def check_taps(target_layer_ids, num_layers: int, store_last_hidden: bool, flag: str = "--engine vllm",
               instead: str = "extract with --engine hf") -> None:
    """UserError for what vLLM captures differently from Hugging Face: the last layer, the final-norm output;
    the message names the caller's ``flag`` and what to do ``instead``."""
    from dflashkit.drafter.vllm_rules import last_layer_tap_reason

    reason = last_layer_tap_reason(target_layer_ids, num_layers)
    if reason:
        raise UserError(f"{flag}: {reason}; or {instead}")
    if store_last_hidden:
        raise UserError("--store-last-hidden with --engine vllm: vLLM's captured states are taken before the "
                        "final norm, so it cannot store the final-norm output; drop the flag or use --engine hf")


def engine_kwargs(model_dir, target_layer_ids, config: VllmCaptureConfig, storage_dir) -> dict:
    """The vllm.LLM keyword arguments of a capture engine."""
    kwargs = {
        "model": str(model_dir), "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization, "dtype": config.dtype,
        "max_num_seqs": config.max_num_seqs, "trust_remote_code": config.trust_remote_code,
        "enable_prefix_caching": False,
        "speculative_config": {"method": METHOD, "num_speculative_tokens": 1, "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(target_layer_ids)}}},
        "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}},
    }
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    return kwargs


# ----------------------------------------------------------------------------- the target, without its weights
@dataclass
class TargetInfo:
    """What the extraction run needs of a target that vLLM runs: the fields of targets.loading.Target it reads."""

    path: str  # what the user named (targets/loading.py resolve_target_dir)
    model_dir: Path  # the safetensors directory vLLM loads
    family: str  # FAMILIES preset name
    tokenizer: Any
    num_layers: int
    hidden_size: int
    vocab_size: int

    def identity(self) -> dict:
        from dflashkit.targets.loading import identity_of

        return identity_of(self.model_dir, self.path)

    def default_layer_ids(self, n: int) -> list[int]:
        from dflashkit.drafter import default_target_layer_ids

        return default_target_layer_ids(self.num_layers, n)


def describe_target(spec: str, trust_remote_code: bool = False) -> TargetInfo:
    """The target named by ``spec`` (directory, .gguf, testbed:NAME) from its config and tokenizer; no weights."""
    from transformers import AutoConfig, AutoTokenizer

    from dflashkit.targets.loading import family_of, identity_of, resolve_target_dir

    model_dir, label = resolve_target_dir(spec)
    family = family_of(model_dir)
    identity_of(model_dir, label)  # no safetensors: the same one-line error as the Hugging Face path
    text = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - the cause is kept in the message
        raise UserError(f"{model_dir}: no tokenizer could be loaded ({error}); save the target's tokenizer "
                        "into that directory (tokenizer.save_pretrained(dir))") from error
    return TargetInfo(label, model_dir, family.name, tokenizer, int(text.num_hidden_layers), int(text.hidden_size),
                      int(text.vocab_size))


# ----------------------------------------------------------------------------- the engine
class VllmCapture:
    """A vLLM engine that captures the taps of every prompt it is given; use as a context manager.

        with VllmCapture(target_dir, [1, 9, 17], VllmCaptureConfig(tensor_parallel_size=8),
                         load_api(settle=False)) as cap:
            per_sample = cap([[1, 2, 3], [4, 5]])  # per prompt: one [T, H] tensor per tap, in id order
    """

    def __init__(self, model_dir, target_layer_ids, config: VllmCaptureConfig, api: VllmApi):
        self.model_dir = Path(model_dir)
        self.layer_ids = [int(i) for i in target_layer_ids]
        self.config = config
        self.api = api
        self.llm = None
        self._scratch: Path | None = None  # the temporary directory (files, a target copy), removed at exit

    def __enter__(self) -> VllmCapture:
        from dflashkit.drafter.vllm_rules import vllm_target_dir

        self.config.check()
        self._scratch = Path(tempfile.mkdtemp(prefix="dflashkit-vllm-", dir=self.config.storage_dir))
        model_dir, _ = vllm_target_dir(self.model_dir, self._scratch)  # a GGUF-converted config: a copy without it
        storage = self._scratch / "hidden_states"
        storage.mkdir()
        self.llm = self.api.llm_factory(**engine_kwargs(model_dir, self.layer_ids, self.config, storage))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """vLLM's own shutdown of the engine core (a child process holding GPU memory), then the files."""
        if self.llm is not None:
            shutdown_core(self.llm)
            self.llm = None
            gc.collect()
            self.api.release()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __call__(self, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
        """Per prompt, the captured [T, H] state of each tap (in target_layer_ids order), on the CPU."""
        if self.llm is None:
            raise RuntimeError("VllmCapture is used outside its `with` block")
        params = self.api.sampling_params(max_tokens=1, temperature=0.0)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} requests")
        return [read_request_file(_file_of(out), prompt, len(self.layer_ids))
                for out, prompt in zip(outputs, prompts)]


def _file_of(output) -> str:
    params = getattr(output, "kv_transfer_params", None) or {}
    if PATH_PARAM not in params:
        raise RuntimeError(f"request {getattr(output, 'request_id', '?')}: no {PATH_PARAM} in kv_transfer_params "
                           f"({params!r}); the engine runs without the {CONNECTOR}")
    return params[PATH_PARAM]


def read_request_file(path: str, prompt: list[int], num_taps: int) -> list[torch.Tensor]:
    """One request's file as one [T, H] tensor per tap; waits for the connector's writer (shared flock on
    ``<path>.lock``), checks the tokens and shapes, deletes the file and its lock."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    started = time.monotonic()
    while not os.path.exists(path) and not os.path.exists(lock):  # the writer creates the lock before the path
        if time.monotonic() - started > 60:
            raise RuntimeError(f"{path}: vLLM reported it but neither it nor its lock appeared within 60 s")
        time.sleep(0.01)
    if os.path.exists(lock):
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_SH)  # sleeps while the writer holds LOCK_EX
            tensors = load_file(path, device="cpu")
        os.remove(lock)
    else:
        tensors = load_file(path, device="cpu")
    os.remove(path)
    hidden, tokens = tensors[HIDDEN_KEY], tensors[TOKENS_KEY]
    if tokens.tolist() != list(prompt):
        raise RuntimeError(f"{path}: token_ids differ from the prompt ({len(tokens)} vs {len(prompt)} tokens); "
                           "the file belongs to another request")
    if hidden.dim() != 3 or hidden.shape[0] != len(prompt) or hidden.shape[1] != num_taps:
        raise RuntimeError(f"{path}: hidden_states {tuple(hidden.shape)}, expected [{len(prompt)}, {num_taps}, H]")
    return list(hidden.unbind(1))
