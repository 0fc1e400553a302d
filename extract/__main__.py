"""``dflashkit extract``: chat data -> the target's layer features, as verifiable, resumable shards.

CPU (testbed, a few samples):
    python -m dflashkit.extract --target testbed:smollm2 --data builtin:sharegpt --limit 64 --out runs/shards
One GPU:
    dflashkit extract --target /models/Qwen3-8B --data chats.jsonl --out runs/q3 --max-length 4096 --codec fp8
Several GPUs (each rank takes every world_size-th sample and writes its own shards; rank 0 merges the manifest):
    accelerate launch --num_processes 8 -m dflashkit.extract --target /models/Qwen3-8B --data chats.jsonl --out runs/q3
A target larger than one GPU, captured by vLLM with tensor parallelism (one process; the `vllm` extra):
    dflashkit extract --engine vllm --tensor-parallel-size 8 --target /models/Llama-3.3-70B --data c.jsonl --out runs/l
A run killed at any point continues with the same command plus --resume; --overwrite replaces what --out holds.
One run per --out: a second one stops at once naming the first (pid, host); the ranks of one launch share it.

The run itself (how samples are batched, captured and written) is ``dflashkit.extract.run``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from dflashkit.drafter.config import DEFAULT_NUM_HIDDEN_LAYERS
from dflashkit.errors import UserError
from dflashkit.extract.data.batching import resolve_tokenize_workers
from dflashkit.extract.data.rendering import BadSample
from dflashkit.extract.run import ENGINES, extract, parse_size
from dflashkit.extract.shards.format import CODECS
from dflashkit.extract.shards.writer import ShardWriteError
from dflashkit.files import disk_full_errno


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer ids {text!r}: write comma-separated integers, e.g. 1,9,17") from None


def workers_arg(text: str):
    """--tokenize-workers: auto or a count >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: use auto or a count >= 0 (0: inline)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflashkit extract", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--target", required=True, help="HF model dir, .gguf file, or testbed:smollm2")
    g.add_argument("--layer-ids", type=parse_layer_ids, default=None,
                   help="comma-separated target_layer_ids (layer i's output)")
    g.add_argument("--num-taps", type=int, default=DEFAULT_NUM_HIDDEN_LAYERS,
                   help="without --layer-ids: this many evenly spaced layers (default: one per drafter layer)")
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="target dtype (default: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: this rank's GPU if any)")
    g.add_argument("--device-map", default=None, help="e.g. auto: spread a large target over this machine's GPUs "
                                                      "(one process only)")
    g.add_argument("--trust-remote-code", action="store_true", help="run the target's own modeling code")
    g = p.add_argument_group("engine (who runs the target)")
    g.add_argument("--engine", choices=ENGINES, default="hf",
                   help="hf: Hugging Face in this process (default); vllm: a vLLM engine captures the taps during "
                        "prefill (pip install 'dflashkit[vllm]'; one process)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="--engine vllm: GPUs the target is spread over")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="--engine vllm: share of each GPU's memory vLLM may take")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="--engine vllm: longest prompt + 1 (default: --max-length + 1, else the target's limit)")
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", required=True,
                   help="jsonl/json/parquet file, directory, saved datasets dir, or builtin:sharegpt|mtbench|"
                        "humaneval; repeat for several (indices continue)")
    g.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    g.add_argument("--limit", type=int, default=None, help="only the first N records")
    g.add_argument("--chat-template", default=None, help="Jinja file replacing the tokenizer's chat template")
    g.add_argument("--chat-template-kwargs", default="{}", help='JSON, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--max-length", type=int, default=None, help="longest sample in tokens")
    g.add_argument("--overlong", choices=("truncate", "drop"), default="truncate", help="over --max-length")
    g.add_argument("--on-bad", choices=("skip", "fail"), default="skip",
                   help="a bad record: skip and count it, or stop naming file:line")
    g = p.add_argument_group("batching and storage")
    g.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    g.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per forward batch")
    g.add_argument("--max-batch-size", type=int, default=64, help="samples per forward batch")
    g.add_argument("--bucket-window", type=int, default=4096, help="samples sorted by length together")
    g.add_argument("--tokenize-workers", type=workers_arg, default="auto",
                   help="processes rendering + tokenizing (0: inline; auto: one per 4 cores of each rank, at most 4)")
    g.add_argument("--shard-size", type=parse_size, default=parse_size("512MB"), help="bytes per shard, e.g. 1GB")
    g.add_argument("--staging-size", type=parse_size, default=parse_size("4GB"),
                   help="host memory for features waiting for the disk (pinned on a GPU); the forward waits "
                        "when it is full")
    g.add_argument("--codec", choices=CODECS, default="bf16", help="feature storage: bf16, or fp8 e4m3 + scale")
    g.add_argument("--store-last-hidden", action="store_true", help="also store the final-norm output")
    g.add_argument("--resume", action="store_true", help="continue a killed run in --out")
    g.add_argument("--overwrite", action="store_true",
                   help="replace what --out holds (an earlier extraction or other files; a file at --out is never "
                        "replaced)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit then fails the write with EFBIG, reported cleanly
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        try:
            template_kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise UserError(f"--chat-template-kwargs {args.chat_template_kwargs!r} is not JSON ({e}); "
                            """write e.g. '{"enable_thinking": false}'""") from None
        extract(args.target, args.data, args.out, layer_ids=args.layer_ids, num_taps=args.num_taps,
                dtype=args.dtype, device=args.device, device_map=args.device_map,
                trust_remote_code=args.trust_remote_code, split=args.split, limit=args.limit,
                chat_template=args.chat_template, chat_template_kwargs=template_kwargs, max_length=args.max_length,
                overlong=args.overlong, on_bad=args.on_bad, batch_tokens=args.batch_tokens,
                max_batch_size=args.max_batch_size, bucket_window=args.bucket_window,
                tokenize_workers=resolve_tokenize_workers(args.tokenize_workers), shard_size=args.shard_size,
                staging_size=args.staging_size, codec=args.codec, store_last_hidden=args.store_last_hidden,
                resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress, engine=args.engine,
                tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
                max_model_len=args.max_model_len)
    except BadSample as e:  # other user errors propagate to dflashkit.cli.run_main (one line, exit 2)
        raise UserError(f"{e}; fix the record, or pass --on-bad skip to skip and count such records") from None
    except ShardWriteError as e:  # NaN/Inf features, an I/O error: a failure; a full disk: the environment's
        if disk_full_errno(e.__cause__) is not None:
            raise UserError(str(e)) from e
        print(f"dflashkit extract: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit extract", main))
