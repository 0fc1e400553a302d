"""From records to forward batches: this rank's share, windows, tokenization, length bucketing, padding.

Design choices:
- Rank r of world_size takes the records whose stable index i has i % world_size == r (and i < limit): disjoint
  shares, no coordination, the same split on every resume.
- Records are taken in windows of ``bucket_window`` (counted over this rank's records, bad ones included), so
  the windows, and the batches cut from them, depend only on the data and the flags.
- Within a window, samples are sorted by length (longest first, ties by index) and cut greedily into batches
  whose padded size (samples x longest) stays within ``batch_tokens`` and ``max_batch_size``: little padding,
  a steady number of tokens per forward. A sample longer than the budget runs alone.
- Tokenizing can run in worker processes (spawned, so no CUDA state is forked), one window ahead.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterator

import torch

from .chat import encode_records, special_tokens
from .rendering import BadSample, ChatConfig
from .sources import iter_records


@dataclass
class Sample:
    index: int  # stable index of the record in the data
    where: str  # file:line of the record
    input_ids: list[int]  # token ids
    loss_mask: list[bool]  # supervised positions
    truncated: bool = False  # cut to max_length
    dropped_leading_turns: int = 0  # leading assistant turns removed


@dataclass
class Window:
    samples: list[Sample] = field(default_factory=list)  # good samples, in data order
    bad: list[BadSample] = field(default_factory=list)  # records that could not become samples


def rank_items(specs, split, limit, rank: int, world_size: int):
    """This rank's records (SourceItem), in index order."""
    for item in iter_records(specs, split):
        if limit is not None and item.index >= limit:
            return
        if item.index % world_size == rank:
            yield item


def count_rank_records(specs, split, limit, rank: int, world_size: int) -> int:
    return sum(1 for _ in rank_items(specs, split, limit, rank, world_size))


# ---------------------------------------------------------------- encoding (inline or in workers)

_WORKER: dict = {}


def _init_worker(tokenizer, cfg: ChatConfig):
    _WORKER.update(tokenizer=tokenizer, cfg=cfg, specials=special_tokens(tokenizer))


def _encode_items(items) -> tuple[list[Sample], list[tuple[str, str, str]]]:
    """These records' samples and skipped ones (reason, detail, where), tokenized together (encode_records)."""
    tok, cfg, specials = _WORKER["tokenizer"], _WORKER["cfg"], _WORKER["specials"]
    encoded = iter(encode_records([item.record for item in items if item.bad is None], tok, cfg, specials))
    samples, bad = [], []
    for item in items:
        s = BadSample(*item.bad) if item.bad is not None else next(encoded)
        if isinstance(s, BadSample):
            bad.append((s.reason, s.detail, item.where))
        else:
            samples.append(Sample(item.index, item.where, s.input_ids, s.loss_mask, s.truncated,
                                  s.dropped_leading_turns))
    return samples, bad


def _chunks(items: list, n: int) -> list[list]:
    size = max(1, -(-len(items) // max(1, n)))
    return [items[i: i + size] for i in range(0, len(items), size)]


def resolve_tokenize_workers(setting, cores: int | None = None, local_processes: int | None = None) -> int:
    """The processes that tokenize the data at start: a count as given; ``auto`` one per 4 of this process's
    cores (the machine's usable cores shared by the launch's processes on it, LOCAL_WORLD_SIZE), at most 4, so
    inline below 8 cores: spawning a worker costs ~2 s, and one process tokenizes ~90k tokens/s."""
    if setting != "auto":
        return int(setting)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    workers = cores // max(1, local_processes) // 4
    return min(4, workers) if workers >= 2 else 0


def encoded_windows(specs, split, limit, bucket_window: int, tokenize_workers: int, tokenizer, cfg: ChatConfig,
                    rank: int, world_size: int) -> Iterator[Window]:
    """Windows of ``bucket_window`` of this rank's records (``specs``, ``split``, ``limit`` as for
    ``iter_records``), encoded; with ``tokenize_workers`` > 0 processes, the next window encodes meanwhile."""
    items = rank_items(specs, split, limit, rank, world_size)
    raw_windows = iter(lambda: list(islice(items, bucket_window)), [])

    def collect(parts) -> Window:
        window = Window()
        for samples, bad in parts:
            window.samples += samples
            window.bad += [BadSample(reason, detail, where) for reason, detail, where in bad]
        return window

    if tokenize_workers <= 0:
        _init_worker(tokenizer, cfg)
        for raw in raw_windows:
            yield collect([_encode_items(raw)])
        return
    import multiprocessing

    with ProcessPoolExecutor(tokenize_workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(tokenizer, cfg)) as pool:
        def submit(raw):
            return [pool.submit(_encode_items, chunk) for chunk in _chunks(raw, tokenize_workers * 4)]

        pending = None
        for raw in raw_windows:
            current = submit(raw)
            if pending is not None:
                yield collect(f.result() for f in pending)
            pending = current
        if pending is not None:
            yield collect(f.result() for f in pending)


# ---------------------------------------------------------------- batches


def plan_batches(samples: list[Sample], batch_tokens: int, max_batch_size: int) -> list[list[Sample]]:
    """Length-bucketed batches: longest first, each within batch_tokens padded tokens and max_batch_size."""
    order = sorted(samples, key=lambda s: (-len(s.input_ids), s.index))
    batches: list[list[Sample]] = []
    for s in order:
        if batches:
            b = batches[-1]
            longest = len(b[0].input_ids)  # sorted: the first is the longest
            if len(b) < max_batch_size and (len(b) + 1) * longest <= batch_tokens:
                b.append(s)
                continue
        batches.append([s])
    return batches


def pad_batch(samples: list[Sample], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [b, T], attention_mask [b, T]) with right padding.

    A right-padded batch needs no attention mask in a causal forward: every padding token comes after every
    real token of its row, so causal attention alone keeps it out of the real tokens' outputs (padding rows get
    junk, which callers drop by length). Without a mask the forward runs the fused causal attention kernels."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    for k, s in enumerate(samples):
        ids[k, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        attn[k, : len(s.input_ids)] = 1
    return ids.to(device), attn.to(device)


def real_token_index(lengths: list[int], padded_length: int, device) -> torch.Tensor:
    """Indices of the real tokens of a right-padded batch in its [b * T] flattening, in order. Gathering with
    it (``index_select``) keeps the device busy: a boolean-mask gather would wait for the device to count."""
    index = torch.cat([torch.arange(n) + k * padded_length for k, n in enumerate(lengths)])
    return index.to(device, non_blocking=True)
