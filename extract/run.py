"""One extraction run: chat data -> the target's layer features -> verifiable, resumable shards.

The command (``dflashkit extract``, ``python -m dflashkit.extract``) parses its flags in ``__main__.py`` into an
``ExtractOptions`` (extract/options.py) and calls ``extract`` here; the demo and the benchmarks build the same
object and call it directly.

Design choices:
- Samples are ordered by their index in the data. Rank r takes the indices i with i % world_size == r, in windows
  of --bucket-window samples; each window is sorted by length and cut into batches of at most --batch-tokens
  padded tokens (length bucketing). The plan depends only on the data and these flags, so a resumed run re-plans
  the same batches and skips those whose samples a shard already holds.
- Features are captured by ``targets.capture.LayerCapture`` (hooks, early exit) and packed to real tokens (an index
  gather, no wait for the device) before they leave the device; ``shards.writer.ShardWriter`` copies them to host
  staging buffers and writes several shards at once on background threads, so the forward waits only for a
  full disk queue.
- Tokenizing (chat template rendering) can run in worker processes (--tokenize-workers), one window ahead of
  the forward passes.
- Bad records are skipped and counted by reason (--on-bad skip) or stop the run naming file:line (--on-bad fail).
- Who runs the target (--engine, recorded in the manifest as ``engine``): Hugging Face in this process (``hf``),
  or a vLLM engine with tensor parallelism (``vllm``, targets/vllm/capture.py: one process, the taps captured
  during prefill, one ``generate`` per planned batch). Everything else (rendering, masks, the batch plan, the
  sample order, the shards) is the same step for both. The engine is chosen once, at the start
  (extract/engines.py): how the target loads, which taps it can capture, how a batch becomes packed features and
  what the manifest records are its own.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflashkit import launch
from dflashkit.errors import UserError
from dflashkit.extract.data import batching
from dflashkit.extract.data.chat import chat_template_hash, tokenizer_hash
from dflashkit.extract.data.rendering import SKIP_REASONS, BadSample, ChatConfig, read_chat_template
from dflashkit.extract.engines import engine_for
from dflashkit.extract.options import ExtractOptions, data_paths
from dflashkit.extract.shards.manifest import MANIFEST, SCHEMA_VERSION, update_totals, write_manifest
from dflashkit.extract.shards.writer import ShardWriter, merge_manifests, prepare_resume

# manifest fields a resumed run must agree on (dotted paths)
RESUME_FIELDS = ("target.config_hash", "target.weights_hash", "tokenizer_hash", "chat_template_hash",
                 "template_kwargs", "target_layer_ids", "codec", "store_last_hidden", "args.max_length",
                 "args.overlong", "args.limit", "args.split", "args.bucket_window", "world_size", "engine.name")
# the flags that shaped the data, recorded in the manifest's ``args``
MANIFEST_ARGS = ("max_length", "overlong", "on_bad", "limit", "split", "batch_tokens", "max_batch_size",
                 "bucket_window", "shard_size")


def _holds_extraction(out: Path) -> bool:
    """Whether ``out`` holds an extraction's files (complete or not)."""
    return out.is_dir() and ((out / MANIFEST).exists() or any(out.glob("shard-*.safetensors"))
                             or any(out.glob("manifest.rank*.json")))


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _check_resume(old: dict, new: dict, out: Path) -> None:
    """The earlier run's settings and data (by content: a path spelled another way is the same data) must be
    this run's."""
    from dflashkit.extract.data.sources import data_difference

    differs = data_difference(old.get("data") or [], new["data"])
    if differs:
        raise UserError(f"--resume: {out} was extracted from other data: {differs}; resume with the original data "
                        "or write to a new --out")
    for field in RESUME_FIELDS:
        if _get(old, field) != _get(new, field):
            raise UserError(f"--resume: {out} was extracted with {field}={_get(old, field)!r}, this run has "
                            f"{_get(new, field)!r}; resume with the original settings or write to a new --out")


def _summary(manifest: dict, out: Path, seconds: float, tokens_this_run: int) -> str:
    t = manifest["totals"]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(manifest["skipped"].items()) if v) or "none"
    notes = ", ".join(f"{k} {v}" for k, v in sorted(manifest.get("notes", {}).items()) if v) or "none"
    return (f"extract: {t['samples']} samples, {t['tokens']} tokens ({t['loss_tokens']} supervised), "
            f"{t['shards']} shards, {t['bytes'] / 2**20:.1f} MiB, {t['bytes_per_token'] or 0:.0f} bytes/token "
            f"({manifest['codec']}), {tokens_this_run / max(seconds, 1e-9):.0f} tokens/s in this run\n"
            f"  skipped: {skipped}\n  notes: {notes}\n  written to {out}")


def extraction_problem(path: Path) -> str | None:
    """Why the directory ``path`` does not hold an extraction (files this command writes), or None."""
    from dflashkit.outputs import describe_foreign, foreign_entries

    foreign = foreign_entries(path, _written_by_extract)
    if foreign:
        return describe_foreign(foreign)
    for manifest in [path / MANIFEST, *path.glob("manifest.rank*.json")]:  # extract's own: JSON with its schema
        if manifest.exists() and not _is_extract_manifest(manifest):
            return f"its {manifest.name} is not a manifest dflashkit extract writes"
    return None


def _is_extract_manifest(path: Path) -> bool:
    """Whether ``path`` is a manifest extract wrote (a JSON object with its schema_version), not only named so."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest


def _written_by_extract(name: str) -> bool:
    """Whether ``name`` in an output directory is a file extraction writes (manifests, shards, their temporaries)."""
    return (name == MANIFEST or (name.startswith("manifest.rank") and name.endswith(".json"))
            or (name.startswith("shard-") and name.endswith(".safetensors"))
            or (name.startswith((".shard-", ".manifest")) and name.endswith(".tmp")))


def _clear_output(out: Path, rank: int) -> None:
    """--overwrite: rank 0 removes the files of the earlier extraction in --out (only those: the lock stays, and
    anything else was refused before, ``extraction_problem``) before any rank writes."""
    import shutil

    if rank == 0:
        for p in out.iterdir():
            if _written_by_extract(p.name):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    launch.barrier()


def extract(opts: ExtractOptions, *, vllm_api=None) -> dict:
    """Extract the features of ``opts.target`` for the records of ``opts.data`` into shards in ``opts.out``;
    return the manifest. ``opts``: the command's flags (extract/options.py); ``vllm_api``: the vLLM calls for
    --engine vllm (targets/vllm/api.py ``VllmApi``; None: the installed vLLM). The run holds the lock on
    ``opts.out`` (dflashkit/outputs.py)."""
    from dflashkit.outputs import OutputLock, check_apart

    check_apart({"--out": opts.out}, {"--data": data_paths(opts.data), "--target": opts.target,
                                      "--chat-template": opts.chat_template})
    with OutputLock(opts.out, "extract"):
        return _extract(opts, vllm_api)


def _extract(opts: ExtractOptions, vllm_api) -> dict:
    """The run under the lock: launch and checks, the target and the manifest, the shards, the summary."""
    # --- launch, inputs, the output -----------------------------------------------------------------------
    engine = engine_for(opts, vllm_api)  # a missing vLLM stops here, in one line, before any work
    rank, world, device, torch_dtype = _join_launch(opts, engine)
    out, data = Path(opts.out), data_paths(opts.data)
    cfg = ChatConfig(max_length=opts.max_length, overlong=opts.overlong,
                     template_kwargs=dict(opts.chat_template_kwargs or {}),
                     chat_template=read_chat_template(opts.chat_template))
    replace = _check_before_loading(out, data, opts)

    # --- the target, the manifest, the resumed position --------------------------------------------------
    target = engine.load_target(torch_dtype, device)
    layer_ids = _tapped_layers(target, opts, cfg, engine)
    manifest = _new_manifest(opts, target, layer_ids, cfg, data, world, torch_dtype, engine.record())
    done = _resumed_samples(out, manifest, rank, world) if opts.resume else set()
    if replace and opts.overwrite:
        _clear_output(out, rank)

    # --- the features, written as shards -----------------------------------------------------------------
    writer = ShardWriter(out, manifest, rank=rank, world_size=world, shard_bytes=opts.shard_size,
                         staging_bytes=opts.staging_size)
    tally = _Tally.start(opts, data, rank, world, len(done))
    try:
        with engine.features(target, layer_ids, device, torch_dtype) as step:
            windows = batching.encoded_windows(data, opts.split, opts.limit, opts.bucket_window,
                                               batching.resolve_tokenize_workers(opts.tokenize_workers),
                                               target.tokenizer, cfg, rank, world)
            _write_features(windows, step, writer, tally, done, opts, world)
        manifest = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        tally.close()

    # --- the manifest, merged over the ranks, and the summary ------------------------------------------
    return _complete(manifest, writer, tally, out, rank, world)


def _join_launch(opts: ExtractOptions, engine):
    """(rank, world size, device, dtype) of this process, in the launch's process group when there are several."""
    rank, world, _ = launch.ranks()
    engine.check_launch(world)
    device = launch.local_device(opts.device)
    launch.join_process_group(device)  # several processes: NCCL on a GPU, gloo on the CPU
    torch_dtype = launch.default_dtype(device, opts.dtype)
    if opts.device_map and world > 1:
        raise UserError("--device-map spreads one target over the GPUs of one process; with several processes "
                        "each rank loads its own copy on its GPU: drop --device-map or launch one process")
    return rank, world, device, torch_dtype


def _check_before_loading(out: Path, data: list[str], opts: ExtractOptions) -> bool:
    """The checks that need no target: the --resume / --overwrite rule, the output directory, records in the
    data, the order of --layer-ids. Whether ``out`` holds something to replace."""
    from dflashkit.drafter import check_target_layer_ids
    from dflashkit.extract.data.sources import check_has_records
    from dflashkit.outputs import check_output_dir, check_resume_flags

    check_resume_flags(out, resume=opts.resume, overwrite=opts.overwrite,
                       holds="an extraction" if _holds_extraction(out) else None)
    replace = check_output_dir(out, what="an extraction", problem=extraction_problem, overwrite=opts.overwrite)
    check_has_records(data, opts.split)  # an empty data file stops here, before the target is loaded
    if opts.layer_ids:
        check_target_layer_ids(list(opts.layer_ids))  # order and duplicates now; the range once the target is loaded
    return replace


def _tapped_layers(target, opts: ExtractOptions, cfg: ChatConfig, engine) -> list[int]:
    """The layers to capture, checked against the loaded target (and against what the engine captures
    differently); the chat template checked against its tokenizer."""
    from dflashkit.drafter import check_target_layer_ids
    from dflashkit.extract.data.chat import check_template

    # default taps: evenly spaced (docs/ARCHITECTURE.md); a target too shallow for that many distinct taps gets fewer
    layer_ids = list(opts.layer_ids) if opts.layer_ids else sorted(set(target.default_layer_ids(opts.num_taps)))
    layer_ids = check_target_layer_ids(layer_ids, target.num_layers)
    engine.check_taps(layer_ids, target.num_layers)
    if cfg.chat_template or getattr(target.tokenizer, "chat_template", None):
        check_template(target.tokenizer, cfg)  # fails here, before any work, when assistant spans cannot be marked
    return layer_ids


def _new_manifest(opts: ExtractOptions, target, layer_ids: list[int], cfg: ChatConfig, data: list[str], world: int,
                  torch_dtype, engine: dict) -> dict:
    """The manifest of this run before any shard is written (extract/shards/manifest.py); its ``args``: the flags
    that shaped it (``MANIFEST_ARGS``); ``engine``: who captured the features (the engine's ``record``)."""
    from dflashkit.extract.data.sources import describe_sources

    tok = target.tokenizer
    return {
        "schema_version": SCHEMA_VERSION, "format": "dflashkit-shards", "complete": False,
        "target": target.identity(), "family": target.family, "tokenizer_hash": tokenizer_hash(tok),
        "chat_template_hash": chat_template_hash(tok, cfg), "template_kwargs": cfg.template_kwargs,
        "chat_template": cfg.chat_template,  # --chat-template's text (None: the tokenizer's); an export records it
        "target_layer_ids": layer_ids, "num_target_layers": target.num_layers, "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "feature_dim": len(layer_ids) * target.hidden_size, "codec": opts.codec,
        "store_last_hidden": bool(opts.store_last_hidden), "dtype": str(torch_dtype).removeprefix("torch."),
        "data": describe_sources(data), "world_size": world, "args": {k: getattr(opts, k) for k in MANIFEST_ARGS},
        "engine": engine, "skipped": {}, "notes": {}, "shards": []}


def _resumed_samples(out: Path, manifest: dict, rank: int, world: int) -> set[int]:
    """--resume: the sample indices this rank's shards already hold (their entries go into ``manifest``), after
    checking that the earlier run had this run's settings."""
    old = prepare_resume(out, rank, world)
    if old is None:
        return set()
    old.setdefault("engine", {"name": "hf"})  # manifests written before --engine: Hugging Face captures
    _check_resume(old, manifest, out)
    manifest["shards"] = old["shards"]
    return {i for s in old["shards"] for i in s["sample_indices"]}


@dataclass
class _Tally:
    """What a run counts as it goes: bad records by reason, notes on the kept ones, the real tokens this rank
    wrote, the time, and rank 0's progress bar."""

    skipped: dict[str, int]  # records skipped, by reason (SKIP_REASONS)
    notes: dict[str, int]  # dropped leading assistant turns, truncated samples
    started: float  # time.time() when the writing started
    bar: object | None = None  # tqdm on rank 0 with progress, else None
    tokens: int = 0  # real tokens this rank wrote in this run

    @classmethod
    def start(cls, opts: ExtractOptions, data: list[str], rank: int, world: int, done: int) -> _Tally:
        tally = cls({r: 0 for r in SKIP_REASONS}, {"dropped_leading_assistant_turns": 0, "truncated": 0},
                    time.time())
        total = batching.count_rank_records(data, opts.split, opts.limit, rank, world)
        if rank == 0 and opts.progress:
            from dflashkit.progress import progress_bar

            tally.bar = progress_bar(total=total * world if total is not None else None, unit="sample",
                                     dynamic_ncols=True, desc="extract", initial=done * world)
        return tally

    def count_window(self, window, on_bad: str) -> dict:
        """Count a window's bad records (--on-bad fail: raise the first) and notes; the snapshot the shards of
        its batches record."""
        for bad in window.bad:
            if on_bad == "fail":
                raise BadSample(bad.reason, bad.detail, bad.where)
            self.skipped[bad.reason] += 1
        for s in window.samples:
            self.notes["dropped_leading_assistant_turns"] += s.dropped_leading_turns
            self.notes["truncated"] += int(s.truncated)
        return {"skipped": dict(self.skipped), "notes": dict(self.notes)}

    def advance(self, samples: int, world: int) -> None:
        if self.bar is not None:
            self.bar.update(samples * world)
            self.bar.set_postfix_str(f"{self.tokens * world / max(time.time() - self.started, 1e-9):,.0f} tok/s",
                                     refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_features(windows, features, writer: ShardWriter, tally: _Tally, done: set[int], opts: ExtractOptions,
                    world: int) -> None:
    """Every window's batches (those not ``done``) through the target (``features``, the engine's), their
    features to ``writer``."""
    for window in windows:
        counts = tally.count_window(window, opts.on_bad)
        for batch in batching.plan_batches(window.samples, opts.batch_tokens, opts.max_batch_size):
            todo = [s for s in batch if s.index not in done]
            if todo:
                tally.tokens += _write_batch(todo, features, writer, counts)
            tally.advance(len(batch), world)


def _write_batch(todo: list, features, writer: ShardWriter, counts: dict) -> int:
    """One forward batch: the samples' layer features, packed to their real tokens, handed to the writer; returns
    the tokens written."""
    hidden, last_hidden = features(todo)
    lengths = [len(s.input_ids) for s in todo]
    writer.add_batch([s.index for s in todo], lengths, [t for s in todo for t in s.input_ids],
                     [m for s in todo for m in s.loss_mask], hidden, last_hidden,
                     where=[s.where for s in todo], counts=counts)
    return sum(lengths)


def _complete(manifest: dict, writer: ShardWriter, tally: _Tally, out: Path, rank: int, world: int) -> dict:
    """Mark this rank's manifest complete; rank 0 merges the ranks' manifests; rank 0 prints the summary."""
    manifest.update(skipped=tally.skipped, notes=tally.notes, complete=True)
    update_totals(manifest)
    write_manifest(writer.manifest_path, manifest)
    launch.barrier()
    if world > 1:
        if rank == 0:
            manifest = merge_manifests(out, world, manifest)
        launch.barrier()
        manifest = json.loads((out / MANIFEST).read_text())
    if rank == 0:
        print(_summary(manifest, out, time.time() - tally.started, tally.tokens * world), file=sys.stderr)
    check_not_all_skipped(manifest, out)
    return manifest


def check_not_all_skipped(manifest: dict, out: Path) -> None:
    """An extraction that holds no sample because every record was skipped is a failure the user must see (exit
    2 naming the reasons), not a success with nothing in it."""
    if manifest["totals"]["samples"]:
        return
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(manifest["skipped"].items()) if v) or "none"
    raise UserError(f"extract: every record was skipped ({skipped}): {out} holds no sample; fix the records "
                    "(--on-bad fail stops at the first bad one, naming its line) and run again with --overwrite")
