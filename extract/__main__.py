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

The flags are the fields of ``ExtractOptions`` (extract/options.py); the run itself (how samples are batched,
captured and written) is ``dflashkit.extract.run``.
"""

from __future__ import annotations

import argparse
import signal
import sys

from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import BadSample
from dflashkit.extract.options import ExtractOptions
from dflashkit.extract.run import extract
from dflashkit.extract.shards.writer import ShardWriteError
from dflashkit.files import disk_full_errno
from dflashkit.options import build_parser as options_parser
from dflashkit.options import parse_options


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, built from its flags (``ExtractOptions``, extract/options.py)."""
    return options_parser(ExtractOptions, prog="dflashkit extract", description=__doc__.split("\n\n")[0])


def main(argv=None) -> int:
    opts = parse_options(ExtractOptions, argv, build_parser())
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit then fails the write with EFBIG, reported cleanly
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        extract(opts)
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
