"""The settings of ``dflashkit extract`` and ``dflashkit regenerate``, each written once: a dataclass whose fields
are the command's flags (dflashkit/options.py builds the parser from it) and which the library call takes.

``ExtractOptions`` goes to ``run.extract``, ``RegenerateOptions`` to ``regenerate.regenerate``; a caller in Python
(the demo, the benchmarks, tests) builds the same object, so a default is the same on the command line and in
Python. Flag values are converted where they are parsed (sizes, layer ids, the JSON of --chat-template-kwargs);
``--tokenize-workers auto`` stays ``"auto"`` until the run resolves it against this process's cores
(``batching.resolve_tokenize_workers``). The options of ``dflashkit verify`` are in ``shards/verify.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflashkit.drafter.config import DEFAULT_NUM_HIDDEN_LAYERS
from dflashkit.options import option

from .generation.answerers import AnswerSettings
from .shards.format import CODECS

DTYPES = ("bfloat16", "float16", "float32")
ENGINES = ("hf", "vllm")  # who runs the target in extract: Hugging Face in this process, or vLLM (engines.py)


# ---------------------------------------------------------------- flag values


def parse_size(text: str) -> int:
    """'512MB' / '2GB' / '64KB' (powers of 1024) or a plain byte count -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number of bytes or e.g. 512MB, 2GB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return int(value)


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer ids {text!r}: write comma-separated integers, e.g. 1,9,17") from None


def parse_tokenize_workers(text: str):
    """--tokenize-workers: auto or a count >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: use auto or a count >= 0 (0: inline)")
    return int(text)


def parse_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object (the keyword arguments the chat template is rendered with)."""
    example = """write e.g. '{"enable_thinking": false}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); {example}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of keyword arguments; {example}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def data_paths(data) -> list[str]:
    """--data as a list of strings (a caller in Python may give one path)."""
    return [str(data)] if isinstance(data, (str, Path)) else [str(d) for d in data]


# ---------------------------------------------------------------- dflashkit extract

_ENGINE = "engine (who runs the target)"
_STORAGE = "batching and storage"


@dataclass
class ExtractOptions:
    """The flags of ``dflashkit extract`` (extract/__main__.py), as ``run.extract`` takes them."""

    target: str = option(help="HF model dir, .gguf file, or testbed:smollm2", required=True, group="target")
    layer_ids: list[int] | None = option(None, parse=parse_layer_ids, group="target",
                                         help="comma-separated target_layer_ids (layer i's output)")
    num_taps: int = option(DEFAULT_NUM_HIDDEN_LAYERS, parse=int, group="target",
                           help="without --layer-ids: this many evenly spaced layers (default: one per drafter layer)")
    dtype: str | None = option(None, choices=DTYPES, group="target",
                               help="target dtype (default: bfloat16 on GPU, float32 on CPU)")
    device: str | None = option(None, help="cpu, cuda, cuda:1 (default: this rank's GPU if any)", group="target")
    device_map: str | None = option(None, group="target", help="e.g. auto: spread a large target over this "
                                                                "machine's GPUs (one process only)")
    trust_remote_code: bool = option(False, help="run the target's own modeling code", group="target")
    engine: str = option("hf", choices=ENGINES, group=_ENGINE,
                         help="hf: Hugging Face in this process (default); vllm: a vLLM engine captures the taps "
                              "during prefill (pip install 'dflashkit[vllm]'; one process)")
    tensor_parallel_size: int = option(1, parse=int, help="--engine vllm: GPUs the target is spread over",
                                       group=_ENGINE)
    gpu_memory_utilization: float = option(0.9, parse=float, group=_ENGINE,
                                           help="--engine vllm: share of each GPU's memory vLLM may take")
    max_model_len: int | None = option(None, parse=int, group=_ENGINE, help="--engine vllm: longest prompt + 1 "
                                       "(default: --max-length + 1, else the target's limit)")
    data: list[str] = option(action="append", required=True, group="data",
                             help="jsonl/json/parquet file, directory, saved datasets dir, or builtin:sharegpt|"
                                  "mtbench|humaneval; repeat for several (indices continue)")
    split: str | None = option(None, help="split of a saved DatasetDict (default: train)", group="data")
    limit: int | None = option(None, parse=int, help="only the first N records", group="data")
    chat_template: str | None = option(None, help="Jinja file replacing the tokenizer's chat template",
                                       group="data")
    chat_template_kwargs: dict = option(help="""JSON, e.g. '{"enable_thinking": false}'""", group="data",
                                        parse=parse_template_kwargs, default_factory=dict)
    max_length: int | None = option(None, parse=int, help="longest sample in tokens", group="data")
    overlong: str = option("truncate", choices=("truncate", "drop"), help="over --max-length", group="data")
    on_bad: str = option("skip", choices=("skip", "fail"), group="data",
                         help="a bad record: skip and count it, or stop naming file:line")
    out: str | Path = option(help="output directory (shards + manifest.json)", required=True, group=_STORAGE)
    batch_tokens: int = option(16384, parse=int, help="padded tokens per forward batch", group=_STORAGE)
    max_batch_size: int = option(64, parse=int, help="samples per forward batch", group=_STORAGE)
    bucket_window: int = option(4096, parse=int, help="samples sorted by length together", group=_STORAGE)
    tokenize_workers: int | str = option("auto", parse=parse_tokenize_workers, group=_STORAGE,
                                         help="processes rendering + tokenizing (0: inline; auto: one per 4 cores "
                                              "of each rank, at most 4)")
    shard_size: int = option(512 << 20, parse=parse_size, help="bytes per shard, e.g. 1GB", group=_STORAGE)
    staging_size: int = option(4 << 30, parse=parse_size, group=_STORAGE,
                               help="host memory for features waiting for the disk (pinned on a GPU); the forward "
                                    "waits when it is full")
    codec: str = option("bf16", choices=CODECS, help="feature storage: bf16, or fp8 e4m3 + scale", group=_STORAGE)
    store_last_hidden: bool = option(False, help="also store the final-norm output", group=_STORAGE)
    resume: bool = option(False, help="continue a killed run in --out", group=_STORAGE)
    overwrite: bool = option(False, group=_STORAGE,
                             help="replace what --out holds (an earlier extraction or other files; a file at --out "
                                  "is never replaced)")
    progress: bool = option(True, flag="--no-progress", action="store_false", help="no progress bar",
                            group=_STORAGE)


# ---------------------------------------------------------------- dflashkit regenerate

_GENERATOR = "generator (one of)"


@dataclass
class RegenerateOptions:
    """The flags of ``dflashkit regenerate`` (extract/regenerate.py), as ``regenerate`` takes them."""

    target: str | None = option(None, group=_GENERATOR,
                                help="HF model dir, .gguf file, or testbed:smollm2 (Hugging Face generation)")
    server: str | None = option(None, group=_GENERATOR,
                                help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1")
    model: str | None = option(None, help="model name to send to the server", group=_GENERATOR)
    api_key: str = option(help="bearer token for the server", group=_GENERATOR,
                          default_factory=lambda: os.environ.get("OPENAI_API_KEY", ""))
    data: list[str] = option(action="append", required=True, help="as for `dflashkit extract`; repeatable",
                             group="data")
    split: str | None = option(None, help="split of a saved DatasetDict", group="data")
    limit: int | None = option(None, parse=int, help="only the first N records", group="data")
    out: str | Path = option(help="output JSONL", required=True, group="data")
    resume: bool = option(False, help="continue a killed run into the same --out", group="data")
    overwrite: bool = option(False, help="start --out afresh, replacing what it holds", group="data")
    on_bad: str = option("skip", choices=("skip", "fail"), help="a bad record: skip it, or stop", group="data")
    max_new_tokens: int = option(1024, parse=positive_int, help="longest answer per turn", group="generation")
    temperature: float = option(0.0, parse=float, help="0: greedy", group="generation")
    top_p: float = option(1.0, parse=float, help="nucleus sampling mass", group="generation")
    top_k: int = option(0, parse=int, help="0: no top-k", group="generation")
    seed: int = option(0, parse=int, help="sampling seed", group="generation")
    chat_template: str | None = option(None, group="generation", help="--target: Jinja file replacing the "
                                       "tokenizer's chat template (as extract and train)")
    chat_template_kwargs: dict = option(help="""JSON, e.g. '{"enable_thinking": false}'""", group="generation",
                                        parse=parse_template_kwargs, default_factory=dict)
    max_prompt_length: int | None = option(None, parse=int, group="generation",
                                           help="a turn whose prompt is longer ends its conversation there (the "
                                                "answered turns are kept; a first turn that long: the conversation "
                                                "is skipped)")
    max_turns: int | None = option(None, parse=int, group="generation", help="answer only the first N user turns "
                                   "of each conversation (later turns are dropped)")
    batch_size: int = option(16, parse=positive_int, group="generation",
                             help="--target: sequences decoded at once (cache slots; HF generate: per call)")
    chunk_factor: int = option(8, parse=positive_int, group="generation",
                               help="--target: conversations answered together, in multiples of --batch-size")
    cuda_graph: bool = option(True, flag="--no-cuda-graph", action="store_false", group="generation",
                              help="--target on a GPU: run each decode step eagerly")
    decode_attention: str = option("triton", choices=("sdpa", "triton"), group="generation",
                                   help="--target on a GPU: decode attention by the Triton kernel that reads each "
                                        "slot up to its own length (default; SDPA where Triton cannot run), or by "
                                        "masked SDPA over the longest slot's length")
    concurrency: int = option(16, parse=positive_int, help="server requests in flight", group="generation")
    dtype: str | None = option(None, choices=DTYPES, help=None, group="generation")
    device: str | None = option(None, help="default: cuda if available, else cpu", group="generation")
    progress: bool = option(True, flag="--no-progress", action="store_false", help=None, group="generation")

    def answer_settings(self) -> AnswerSettings:
        """What every answer is asked with, by a local target or a server."""
        return AnswerSettings(max_new_tokens=self.max_new_tokens, template_kwargs=dict(self.chat_template_kwargs or {}),
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
