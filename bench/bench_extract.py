"""Extraction throughput against the plain target forward, the output_hidden_states=True approach, and the disk.

    python -m bench.bench_extract --toy --out /tmp/bench_extract_toy.json                  # CPU, seconds
    python -m bench.bench_extract --target /root/testbed/smollm2-bf16 --out runs/bench/extract_smollm2.json
    python -m bench.bench_extract --random-qwen3-8b --layer-ids 1 9 17 25 33 --batch 8 --seq 2048 \
        --out runs/bench/extract_qwen3_8b.json
    python -m bench.bench_extract --writer-only --batch 2 --batches 12 --out /tmp/bench_writer.json   # CPU

On the same batches (random token ids, every token real), median over --repeats runs of --batches batches each:
- forward: plain ``model(input_ids)`` (logits included), what serving the target costs;
- hidden_states: ``output_hidden_states=True`` then concatenating the chosen layers, still on the device (the
  approach of trainers that keep every layer; it writes nothing, so it is the baseline's best case);
- capture_{bf16,fp8}: the device half of extraction alone: hooks on target_layer_ids with early exit (no later
  layers, no lm_head), real-token gather, codec encoding; nothing leaves the device (the fastest extraction
  can be);
- dflashkit_{bf16,fp8}: the extraction path of ``dflashkit extract``: the capture above, then copies into host
  staging buffers and shards written to --out-dir by ``ShardWriter`` with --shard-size and --writer-threads,
  ``close()`` (the last fsync) included in the time (``writes_ahead`` in the JSON: whether the directory's file
  system let shards be written ahead of their turn). The time starts at the first batch: the writer's set-up
  (allocating --staging-size of pinned host memory, once per extraction however long it runs) is reported
  apart (``writer_setup_s_*``), and deleting the previous run's shards is not timed;
- disk: the disk's sequential write ceiling, measured in the same run: the same number of bytes as one
  extraction run writes, written to the same directory in 64 MiB writes, then fsync (what ``dd conv=fsync``
  does), median over --repeats.
--writer-only: no model; synthetic features of --feature-dim (default Qwen3-8B's 5 taps x 4096) already in bf16
on the host, as the capture hands them over, fed through ``ShardWriter.add_batch`` as fast as it takes them;
reported per codec: bytes/s written ÷ the disk ceiling of the same directory in the same run, and the seconds the
caller spent inside ``add_batch`` (on a CPU it encodes and copies into staging itself; on a GPU both are queued on
the device). --prior-samples N starts each run from a manifest that already lists N samples (a long or resumed
run), to show what the manifest costs as the data set grows. --forward-s S: before each batch the caller holds the
interpreter lock for S seconds as the thread that launches a GPU-bound forward does (its kernel launches block
with the lock held once the GPU's queue is full; ``hold_the_lock``); the writer's threads then get the lock only
at the switch interval, as in a real run. Reported then: run time ÷ the forwards' time.
Ratios: extraction tokens/s ÷ forward (and ÷ capture: 1.0 when writing costs the forward nothing); extraction
bytes/s ÷ the disk ceiling (1.0: the disk is the bound). Also
reported: the seconds the forward waited for free staging buffers (waiting on the disk), per run, and how a
run's time splits into the capture loop (with the writer working beside it) and ``close()`` (what the writer still
had to do after the last batch). Prints a table
and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import qwen3_8b_config, random_target, sync, timed, write_json
from dflashkit import launch
from dflashkit.extract.data.batching import real_token_index
from dflashkit.extract.options import parse_size
from dflashkit.extract.shards.format import encode_features
from dflashkit.extract.shards.writer import WRITER_THREADS, ShardWriter
from dflashkit.targets.capture import LayerCapture
from dflashkit.targets.loading import load_target


def disk_ceiling(directory: Path, nbytes: int, repeats: int) -> list[float]:
    """Seconds to write ``nbytes`` to one new file in ``directory`` in 64 MiB writes, then fsync."""
    chunk = memoryview(os.urandom(64 << 20))
    path = directory / "disk-ceiling.bin"
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, chunk.nbytes)])
        os.fsync(fd)
        os.close(fd)
        out.append(time.perf_counter() - t)
        path.unlink()
    return out


def prior_shards(n_samples: int, per_shard: int) -> list[dict]:
    """Manifest entries of an earlier part of the run: ``n_samples`` samples in shards of ``per_shard``."""
    out = []
    for seq, lo in enumerate(range(0, n_samples, per_shard)):
        idx = list(range(lo, min(lo + per_shard, n_samples)))
        out.append({"file": f"shard-r000-{seq:06d}.safetensors", "rank": 0, "seq": seq, "samples": len(idx),
                    "tokens": 1000 * len(idx), "loss_tokens": 500 * len(idx), "bytes": 41 << 20, "sha256": "0" * 64,
                    "sample_indices": idx})
    return out


def hold_the_lock(seconds: float) -> None:
    """For ``seconds``, hold the interpreter lock as the forward's launching thread does: blocked in C with the lock
    held (a kernel launch waiting for room in the GPU's queue), back in Python every 0.2 ms, using no core while
    blocked (libc usleep called through ctypes.PyDLL, which keeps the lock; a busy loop where that is missing)."""
    import ctypes

    try:
        usleep = ctypes.PyDLL(None).usleep
    except (AttributeError, OSError):
        usleep = None
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        usleep(200) if usleep is not None else sum(range(100))


@dataclass(frozen=True)
class WriterSettings:
    """The shard writer's settings under test (``ShardWriter``'s keywords, as `dflashkit extract` sets them)."""

    shard_bytes: int  # bytes per shard
    staging_bytes: int  # bytes of features held in memory before the caller waits
    writer_threads: int  # shards written at once


def writer_only(base: Path, batch: int, seq: int, feature_dim: int, n_batches: int, repeats: int,
                settings: WriterSettings, prior_samples: int, forward_s: float = 0.0) -> dict:
    """The writer alone on the host: synthetic bf16 features [batch * seq, feature_dim] per batch."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch * seq, feature_dim, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (batch * seq,), generator=g, dtype=torch.int32)
    mask = torch.ones(batch * seq, dtype=torch.bool)
    lengths = [seq] * batch
    results = {"mode": "writer-only", "batch": batch, "seq": seq, "feature_dim": feature_dim, "batches": n_batches,
               "tokens_per_run": batch * seq * n_batches, **asdict(settings), "prior_samples": prior_samples,
               "forward_s": forward_s,
               "device": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for codec in ("bf16", "fp8"):
        out = base / codec
        written, caller = [], []

        def run():
            shutil.rmtree(out, ignore_errors=True)
            prior = prior_shards(prior_samples, max(batch, 1))
            n_prior = len(prior)
            writer = ShardWriter(out, {"codec": codec, "schema_version": 1, "shards": prior}, **asdict(settings))
            inside = 0.0
            for n in range(n_batches):
                hold_the_lock(forward_s)
                t = time.perf_counter()
                writer.add_batch(list(range(prior_samples + n * batch, prior_samples + (n + 1) * batch)), lengths,
                                 ids, mask, hidden)
                inside += time.perf_counter() - t
            m = writer.close()
            written.append(sum(s["bytes"] for s in m["shards"][n_prior:]))
            caller.append(inside)
            results["writes_ahead"] = writer.writes_ahead

        results[f"writer_{codec}"] = timed(lambda i: run(), repeats, 1, "cpu")  # the first run: the warm-up
        results[f"caller_s_{codec}"] = caller[1:]
        results[f"bytes_per_run_{codec}"] = written[-1]
        results[f"disk_{codec}"] = disk_ceiling(out, written[-1], repeats)
        shutil.rmtree(out, ignore_errors=True)
        nbytes = written[-1]
        results[f"write_bytes_per_s_{codec}"] = nbytes / statistics.median(results[f"writer_{codec}"])
        results[f"disk_ceiling_bytes_per_s_{codec}"] = nbytes / statistics.median(results[f"disk_{codec}"])
        results[f"ratio_vs_disk_ceiling_{codec}"] = (results[f"write_bytes_per_s_{codec}"]
                                                     / results[f"disk_ceiling_bytes_per_s_{codec}"])
        results[f"ratio_vs_forward_{codec}"] = (n_batches * forward_s / statistics.median(results[f"writer_{codec}"])
                                                if forward_s else None)
    return results


def print_writer_only(results: dict) -> None:
    print(f"writer only: {results['batches']} batches of {results['batch']} x {results['seq']} tokens x "
          f"{results['feature_dim']} features, median of the repeats, {results['writer_threads']} writer threads, "
          f"{results['prior_samples']} samples listed before, {results['forward_s']} s of forward per batch, "
          f"shards written ahead: {results['writes_ahead']}")
    print("| codec | MB per run | s per run | s inside add_batch | MB/s written | disk ceiling MB/s | ÷ disk ceiling "
          "| ÷ forward |")
    print("|---|---|---|---|---|---|---|---|")
    for codec in ("bf16", "fp8"):
        print(f"| {codec} | {results['bytes_per_run_' + codec] / 1e6:,.0f} | "
              f"{statistics.median(results['writer_' + codec]):.2f} | "
              f"{statistics.median(results['caller_s_' + codec] or [0.0]):.2f} | "
              f"{results['write_bytes_per_s_' + codec] / 1e6:,.0f} | "
              f"{results['disk_ceiling_bytes_per_s_' + codec] / 1e6:,.0f} | "
              f"{results['ratio_vs_disk_ceiling_' + codec]:.3f} | "
              + (f"{results['ratio_vs_forward_' + codec]:.3f} |" if results["forward_s"] else "- |"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="a target dflashkit loads (HF dir, .gguf, testbed:smollm2), in bfloat16")
    g.add_argument("--random-qwen3-8b", action="store_true", help="random weights, Qwen3-8B's shape")
    g.add_argument("--toy", action="store_true", help="a tiny random Qwen3 and small batches: runs on a CPU")
    g.add_argument("--writer-only", action="store_true", help="no model: synthetic features through the writer")
    ap.add_argument("--feature-dim", type=int, default=5 * 4096, help="--writer-only: features per token")
    ap.add_argument("--forward-s", type=float, default=0.0,
                    help="--writer-only: seconds of lock-holding Python per batch, standing in for the forward")
    ap.add_argument("--prior-samples", type=int, default=0, help="--writer-only: samples the manifest lists before")
    ap.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    ap.add_argument("--layer-ids", type=int, nargs="+", help="default: 5 evenly spaced layers")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (default 8; toy 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; toy 64)")
    ap.add_argument("--batches", type=int, default=None, help="batches per timed run (default 16; toy 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-size", type=parse_size, default=parse_size("512MB"), help="as `dflashkit extract`")
    ap.add_argument("--staging-size", type=parse_size, default=parse_size("4GB"), help="as `dflashkit extract`")
    ap.add_argument("--writer-threads", type=int, default=WRITER_THREADS,
                    help=f"shards written at once (default {WRITER_THREADS}, as `dflashkit extract`)")
    ap.add_argument("--out-dir", default=None, help="where shards go (default: a temp dir on the local disk)")
    ap.add_argument("--out", "--json", dest="out", default="bench_extract.json", help="JSON results")
    args = ap.parse_args(argv)
    if args.writer_only:
        base = Path(args.out_dir or tempfile.mkdtemp(prefix="dflashkit-bench-"))
        base.mkdir(parents=True, exist_ok=True)
        settings = WriterSettings(args.shard_size, args.staging_size, args.writer_threads)
        results = writer_only(base, args.batch or 8, args.seq or 2048, args.feature_dim, args.batches or 16,
                              args.repeats, settings, args.prior_samples, args.forward_s)
        if not args.out_dir:
            shutil.rmtree(base, ignore_errors=True)
        write_json(args.out, results)
        print_writer_only(results)
        print(f"wrote {args.out}")
        return
    dev = launch.local_device(args.device)
    batch = args.batch or (2 if args.toy else 8)
    seq = args.seq or (64 if args.toy else 2048)
    n_batches = args.batches or (4 if args.toy else 16)
    shard_bytes = min(args.shard_size, 16 << 10) if args.toy else args.shard_size
    dtype = launch.default_dtype(dev)
    torch.manual_seed(0)
    if args.target:
        target = load_target(args.target, dtype=dtype, device=dev)
    else:
        label = "random:qwen3-toy" if args.toy else "random:qwen3-8b"
        target = random_target(qwen3_8b_config(toy=args.toy), dev, dtype, label, family="qwen3")
    ids = args.layer_ids or sorted(set(target.default_layer_ids(5)))
    batches_cpu = [torch.randint(0, target.vocab_size, (batch, seq)) for _ in range(n_batches)]
    batches = [x.to(dev) for x in batches_cpu]
    mask = torch.ones_like(batches[0])
    lengths = [seq] * batch
    keep = real_token_index(lengths, seq, dev)
    tokens = batch * seq * n_batches
    model = target.model

    @torch.inference_mode()
    def plain():
        for x in batches:
            model(input_ids=x, attention_mask=mask, use_cache=False)

    @torch.inference_mode()
    def all_states():
        for x in batches:
            hs = model(input_ids=x, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states
            torch.cat([hs[i + 1] for i in ids], dim=-1)

    results = {"target": target.path, "layer_ids": ids, "batch": batch, "seq": seq, "batches": n_batches,
               "tokens_per_run": tokens, "shard_bytes": shard_bytes, "staging_bytes": args.staging_size,
               "writer_threads": args.writer_threads,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results["forward"] = timed(lambda i: plain(), args.repeats, 1, dev)
    results["hidden_states"] = timed(lambda i: all_states(), args.repeats, 1, dev)
    base = Path(args.out_dir or tempfile.mkdtemp(prefix="dflashkit-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    for codec in ("bf16", "fp8"):
        def capture_only():
            with LayerCapture(target, ids) as capture:
                for x in batches:
                    hidden, _ = capture(x, mask)
                    encode_features(hidden.flatten(0, 1).index_select(0, keep), codec)

        results[f"capture_{codec}"] = timed(lambda i: capture_only(), args.repeats, 1, dev)
        out = base / codec
        written, waited, phases = [], [], []

        def extract():
            shutil.rmtree(out, ignore_errors=True)  # the previous run's shards (not timed)
            sync(dev)
            setup = time.perf_counter()
            writer = ShardWriter(out, {"codec": codec, "schema_version": 1}, shard_bytes=shard_bytes,
                                 staging_bytes=args.staging_size, writer_threads=args.writer_threads)
            started = time.perf_counter()
            with LayerCapture(target, ids) as capture:
                for n, (x, x_cpu) in enumerate(zip(batches, batches_cpu)):
                    hidden, _ = capture(x, mask)
                    writer.add_batch(list(range(n * batch, (n + 1) * batch)), lengths, x_cpu.flatten(),
                                     torch.ones(batch * seq, dtype=torch.bool),
                                     hidden.flatten(0, 1).index_select(0, keep))
            sync(dev)
            closing = time.perf_counter()
            m = writer.close()
            phases.append([started - setup, closing - started, time.perf_counter() - closing])
            written.append(sum(s["bytes"] for s in m["shards"]))
            waited.append(writer.pool.wait_seconds)
            results["writes_ahead"] = writer.writes_ahead

        for _ in range(args.repeats + 1):  # the first run is the warm-up
            extract()
        results[f"dflashkit_{codec}"] = [p[1] + p[2] for p in phases[1:]]
        results[f"writer_setup_s_{codec}"] = [p[0] for p in phases[1:]]
        results[f"bytes_per_run_{codec}"] = written[-1]
        results[f"staging_wait_s_{codec}"] = waited[1:]
        results[f"capture_with_writer_s_{codec}"] = [p[1] for p in phases[1:]]
        results[f"close_s_{codec}"] = [p[2] for p in phases[1:]]
        results[f"disk_{codec}"] = disk_ceiling(out, written[-1], args.repeats)
        shutil.rmtree(out, ignore_errors=True)
    if not args.out_dir:
        shutil.rmtree(base, ignore_errors=True)
    tok_s = {k: tokens / statistics.median(results[k]) for k in
             ("forward", "hidden_states", "capture_bf16", "capture_fp8", "dflashkit_bf16", "dflashkit_fp8")}
    results["tokens_per_s"] = tok_s
    for codec in ("bf16", "fp8"):
        nbytes = results[f"bytes_per_run_{codec}"]
        results[f"write_bytes_per_s_{codec}"] = nbytes / statistics.median(results[f"dflashkit_{codec}"])
        results[f"disk_ceiling_bytes_per_s_{codec}"] = nbytes / statistics.median(results[f"disk_{codec}"])
        results[f"ratio_vs_forward_{codec}"] = tok_s[f"dflashkit_{codec}"] / tok_s["forward"]
        results[f"ratio_vs_hidden_states_{codec}"] = tok_s[f"dflashkit_{codec}"] / tok_s["hidden_states"]
        results[f"ratio_vs_capture_{codec}"] = tok_s[f"dflashkit_{codec}"] / tok_s[f"capture_{codec}"]
        results[f"ratio_vs_disk_ceiling_{codec}"] = (results[f"write_bytes_per_s_{codec}"]
                                                     / results[f"disk_ceiling_bytes_per_s_{codec}"])
    write_json(args.out, results)
    print(f"target {target.path} on {results['device']}, taps {ids}, {n_batches} batches of {batch} x {seq}, "
          f"median of {args.repeats}, {args.writer_threads} writer threads, shards written ahead (unnamed files): "
          f"{results['writes_ahead']}")
    print("| path | tok/s | ÷ forward | ÷ capture | ÷ hidden_states | bytes/token | MB/s written | ÷ disk ceiling "
          "| forward waited (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in ("forward", "hidden_states", "capture_bf16", "capture_fp8"):
        print(f"| {k} | {tok_s[k]:,.0f} | {tok_s[k] / tok_s['forward']:.3f} | - | "
              f"{tok_s[k] / tok_s['hidden_states']:.3f} | - | - | - | - |")
    for codec in ("bf16", "fp8"):
        k = f"dflashkit_{codec}"
        wait = statistics.median(results[f"staging_wait_s_{codec}"] or [0.0])
        print(f"| {k} | {tok_s[k]:,.0f} | {results['ratio_vs_forward_' + codec]:.3f} | "
              f"{results['ratio_vs_capture_' + codec]:.3f} | {results['ratio_vs_hidden_states_' + codec]:.3f} | "
              f"{results['bytes_per_run_' + codec] / tokens:,.0f} | "
              f"{results['write_bytes_per_s_' + codec] / 1e6:,.0f} | {results['ratio_vs_disk_ceiling_' + codec]:.3f} "
              f"| {wait:.2f} |")
    for codec in ("bf16", "fp8"):
        print(f"dflashkit_{codec}: the capture loop with the writer running "
              f"{statistics.median(results['capture_with_writer_s_' + codec]):.2f} s (alone "
              f"{statistics.median(results['capture_' + codec]):.2f} s), then close() "
              f"{statistics.median(results['close_s_' + codec]):.2f} s (the writer's backlog); before the loop, "
              f"once per extraction and not in the time: the writer's set-up (pinned staging) "
              f"{statistics.median(results['writer_setup_s_' + codec]):.2f} s")
    for codec in ("bf16", "fp8"):
        print(f"disk ceiling ({results['bytes_per_run_' + codec] / 1e6:,.0f} MB, write + fsync): "
              f"{results['disk_ceiling_bytes_per_s_' + codec] / 1e6:,.0f} MB/s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
