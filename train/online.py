"""Online training data: chat records -> token ids (extraction's chat code) -> the frozen target's layer features,
computed inside the training loop instead of read from shards.

Design choices:
- ``OnlineFeatures`` looks like a ``ShardDataset`` to the trainer: ``ds[i]`` is the same dict (``input_ids``,
  ``loss_mask``, ``hidden`` [T, K*H] bf16, optional ``last_hidden`` [T, H], ``sample_index``), so the same
  collate, anchors, masks, losses, held-out split, checkpoints and resume apply to both paths.
- Sample ``i`` is the i-th good record of the data in record order (bad records are skipped and counted). A
  ``ShardDataset`` numbers its samples the same way (by ``sample_index``, whatever order extraction wrote them
  in), so the two paths split, shuffle and anchor samples identically.
- Records are rendered and masked once, at start, by ``extract.data.batching`` (the code extraction runs; optional
  worker processes). Token ids stay on the CPU; only features live on the training device.
- The target is loaded per process (each rank holds its own frozen replica; it is never given to accelerate, so
  DDP / FSDP / DeepSpeed wrap only the drafter), in eval mode without gradients, bf16 on a GPU. Its features
  come from ``target.capture.LayerCapture`` (forward hooks, early exit after the deepest layer needed; with
  ``store_last_hidden`` the final-norm output of the same forward, for the ``kl`` loss).
- The trainer announces the order in which it will read samples (``plan``). Reading the next planned sample runs
  the target once on it and the planned samples after it, right-padded, up to ``batch_tokens`` padded tokens,
  and keeps that batch's features until the next batch; any other read (a repeated sample that pads the last
  step of an epoch) runs the sample alone, and ``read`` (held-out evaluation's packs) runs the samples it is
  given batched the same way. The outcome depends on this batching only through
  float rounding.
- Features are handed over in bf16, the dtype shards store them in, so an online run and an ``extract`` +
  ``train --shards`` run on the same samples see the same numbers.
- What runs the target is one step, ``run_target`` (with ``open_capture``, what it holds open): the target in
  this process here; a vLLM engine in train/online_vllm.py (``target_engine=vllm``), with the same plan, batches
  and dicts.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from dflashkit import launch
from dflashkit.errors import UserError

FEATURE_DTYPE = torch.bfloat16  # what shards store and the drafter reads


def check_drafter_matches_target(dcfg, target) -> None:
    """The online counterpart of the shard manifest check: the drafter config against the live target."""
    from dflashkit.targets.capture import check_layer_ids

    for key, live in (("hidden_size", target.hidden_size), ("num_target_layers", target.num_layers),
                      ("vocab_size", target.vocab_size)):
        mine = getattr(dcfg, key, None)
        if mine is not None and int(mine) != int(live):
            raise UserError(f"{key}: the target {target.path} has {key}={live} but the drafter config has "
                            f"{key}={mine}; train with the target the drafter was built for, or start a new "
                            f"drafter (drop init_from)")
    check_layer_ids(dcfg.target_layer_ids, target.num_layers)  # its message starts with target_layer_ids


def target_head_of(target, dtype: torch.dtype):
    """The target's embedding, final norm and lm_head as a ``TargetHead`` sharing the live target's tensors."""
    from torch import nn

    from dflashkit.targets.loading import TargetHead

    embed = nn.Embedding.from_pretrained(target.embed_tokens.weight, freeze=True)  # plain rows: TargetHead scales
    head = TargetHead(embed, target.final_norm, target.lm_head, target.embedding_scale, target.config,
                      target.model_dir, target.path)
    return head.to(dtype=dtype).requires_grad_(False).eval()


def encode_data(specs: list[str], tokenizer, *, max_length: int | None, chat_template: str, template_kwargs: dict,
                limit: int | None, tokenize_workers: int, say=print, cache_dir: str | None = None,
                write_cache: bool = True) -> list:
    """Every good record of ``specs`` as an ``extract.data.batching.Sample``, in record order (bad ones counted).

    With ``cache_dir`` the token ids are kept in ``cache_dir/<key>.safetensors`` (``write_cache``: this process
    writes it; one rank is enough) and read from there next time: a resumed or restarted run skips rendering
    and tokenizing. The key covers the data files (path, size, modification time), the tokenizer, the chat
    settings and the chat code itself, so any change re-encodes."""
    from dflashkit.extract.data import batching
    from dflashkit.extract.data.chat import check_template
    from dflashkit.extract.data.rendering import SKIP_REASONS, ChatConfig, read_chat_template

    template = read_chat_template(chat_template, flag="chat_template")
    cfg = ChatConfig(max_length=max_length, overlong="truncate", template_kwargs=dict(template_kwargs),
                     chat_template=template)
    cache = Path(cache_dir) / f"{token_cache_key(specs, tokenizer, cfg, limit)}.safetensors" if cache_dir else None
    cached = read_token_cache(cache, say) if cache is not None and cache.exists() else None
    if cached is not None:
        samples, skipped = cached
    else:
        if cfg.chat_template or getattr(tokenizer, "chat_template", None):
            check_template(tokenizer, cfg)  # fails before any work when assistant spans cannot be marked
        samples, skipped = [], {r: 0 for r in SKIP_REASONS}
        for window in batching.encoded_windows(list(specs), None, limit, bucket_window=4096,
                                               tokenize_workers=tokenize_workers, tokenizer=tokenizer, cfg=cfg,
                                               rank=0, world_size=1):
            for sample in window.samples:  # arrays: 5 bytes a token instead of two Python lists
                sample.input_ids = np.asarray(sample.input_ids, dtype=np.int32)
                sample.loss_mask = np.asarray(sample.loss_mask, dtype=np.bool_)
            samples += window.samples
            for bad in window.bad:
                skipped[bad.reason] += 1
        samples.sort(key=lambda s: s.index)
        if cache is not None and write_cache and samples:
            keep_token_cache(cache, samples, skipped, say)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()) if v) or "none"
    say(f"online data: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens from "
        f"{', '.join(specs)} (skipped: {counts}){f'; token ids read from {cache}' if cached else ''}")
    if not samples:
        raise UserError(f"data {specs}: no usable sample (skipped: {counts}); check the files' format "
                        "(messages / conversations / prompt+response / text records)")
    return samples


# ---------------------------------------------------------------- token cache

TOKEN_CACHE_FORMAT = 1


def token_cache_key(specs: list[str], tokenizer, cfg, limit: int | None) -> str:
    """A digest of everything the encoded samples depend on."""
    import hashlib
    import json
    from dataclasses import asdict

    from dflashkit.extract.data import chat, rendering, sources

    files = []
    for spec in specs:
        path = sources.builtin_path(spec) if spec.startswith("builtin:") else Path(spec).expanduser()
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    parts = {"format": TOKEN_CACHE_FORMAT, "specs": list(specs), "files": files, "limit": limit,
             "tokenizer": [getattr(tokenizer, "name_or_path", ""), len(tokenizer),
                           getattr(tokenizer, "chat_template", None) or ""],
             "chat": asdict(cfg),
             "code": hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (chat, rendering))).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def keep_token_cache(path: Path, samples: list, skipped: dict, say=print) -> None:
    """``write_token_cache``, or a note when its directory cannot take it (read-only, another user's, a file in
    the way, a full disk): the cache only saves a resumed run the tokenizing, so training goes on without it."""
    import errno

    try:
        write_token_cache(path, samples, skipped)
    except (OSError, UserError) as error:
        if isinstance(error, OSError) and error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM,
                                                              errno.ENOTDIR, errno.EEXIST):
            raise
        said = error.strerror if isinstance(error, OSError) else str(error)
        say(f"note: token cache {path} not written ({said}); training goes on without it (a resumed run "
            f"tokenizes again); make {path.parent} writable, or set token_cache=false")


def write_token_cache(path: Path, samples: list, skipped: dict) -> None:
    """All samples' ids and masks as flat arrays with offsets, written durably (dflashkit/files.py)."""
    import json
    from functools import partial

    from dflashkit.files import atomic_write_with

    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    arrays = {"input_ids": np.concatenate([s.input_ids for s in samples]).astype(np.int32),
              "loss_mask": np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
              "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
              "index": np.array([s.index for s in samples], dtype=np.int64)}
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"skipped": json.dumps(skipped), "format": str(TOKEN_CACHE_FORMAT)}
    atomic_write_with(path, partial(_save_arrays, arrays=arrays, metadata=metadata))


def _save_arrays(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """safetensors' ``save_file`` for numpy arrays, the file's mode following the umask (save_file makes it 0600;
    the run's other files follow the umask)."""
    from safetensors.numpy import save_file

    from dflashkit.outputs import honour_umask

    save_file(arrays, str(path), metadata=metadata)
    honour_umask(path)


def read_token_cache(path: Path, say=print):
    """(samples, skipped) from a token cache, or None (with a note) when it cannot be read: then re-encode."""
    import json

    from safetensors import safe_open

    from dflashkit.extract.data.batching import Sample

    try:
        with safe_open(str(path), framework="numpy") as f:
            skipped = json.loads(f.metadata()["skipped"])
            ids, mask, offsets, index = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets", "index"))
        if len(offsets) != len(index) + 1 or offsets[-1] != len(ids) or len(mask) != len(ids):
            raise ValueError("array sizes disagree")
    except Exception as e:  # a cut or foreign file must not stop training: encode again and overwrite it
        say(f"note: token cache {path} unreadable ({e}); encoding the data again")
        return None
    samples = [Sample(index=int(index[k]), where=f"{path}#{k}", input_ids=ids[offsets[k]:offsets[k + 1]],
                      loss_mask=mask[offsets[k]:offsets[k + 1]].astype(np.bool_)) for k in range(len(index))]
    return samples, skipped


def padded_batch_end(order: list[int], start: int, lengths, batch_tokens: int) -> int:
    """The end of the batch that starts at ``order[start]``: the samples after it while the right-padded batch
    (count x longest) fits ``batch_tokens`` and no sample repeats; at least one sample."""
    end, longest = start, 0
    while end < len(order):
        longest_next = max(longest, lengths[order[end]])
        if end > start and ((end - start + 1) * longest_next > batch_tokens or order[end] in order[start:end]):
            break
        longest, end = longest_next, end + 1
    return end


class OnlineFeatures(torch.utils.data.Dataset):
    """Samples with features from the live target: ``ds[i]`` -> the dict a ``ShardDataset`` returns. A context
    manager: the capture hooks are on the target inside ``with OnlineFeatures(...) as ds`` (or while an ExitStack
    holds it: the trainer's), and removed on leaving it, whatever ends it."""

    def __init__(self, target, samples: list, target_layer_ids, *, store_last_hidden: bool, batch_tokens: int,
                 device):
        self.target, self.samples, self.device = target, samples, torch.device(device)
        self.store_last_hidden = bool(store_last_hidden)
        self.has_last_hidden = self.store_last_hidden  # the ShardDataset attribute the trainer reads
        self.batch_tokens = int(batch_tokens)
        self.capture = self.open_capture(list(target_layer_ids))
        self._hooks = ExitStack()  # holds the capture (its hooks, or an engine) while this dataset is entered
        self._plan: list[int] = []
        self._pos = 0
        self._cache: dict[int, dict] = {}
        self.lengths = [len(s.input_ids) for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def open_capture(self, target_layer_ids: list[int]):
        """What runs the target with its taps, a context manager entered with this dataset: forward hooks on the
        target of this process (a subclass may run it elsewhere, train/online_vllm.py)."""
        from dflashkit.targets.capture import LayerCapture

        return LayerCapture(self.target, target_layer_ids, store_last_hidden=self.store_last_hidden)

    def __enter__(self) -> "OnlineFeatures":
        self._hooks.enter_context(self.capture)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.close()

    def plan(self, indices: list[int]) -> None:
        """The order in which the sample indices will be read (one epoch's share of this rank)."""
        self._plan, self._pos, self._cache = list(indices), 0, {}

    def __getitem__(self, i: int) -> dict:
        if i in self._cache:
            return self._cache[i]
        if self._pos < len(self._plan) and self._plan[self._pos] == i:
            self._cache = self.features(self._next_planned())
            return self._cache[i]
        return self.features([i])[i]  # out of plan: alone, leaving the planned batch in place

    def read(self, indices: list[int]) -> dict[int, dict]:
        """{index: sample dict} of these samples out of plan (held-out evaluation, train/evaluate.py): the target
        run on them in order, in right-padded batches as the planned reads' (``padded_batch_end``), leaving the
        planned batch in place."""
        out = {i: self._cache[i] for i in indices if i in self._cache}
        todo = list(dict.fromkeys(i for i in indices if i not in out))
        start = 0
        while start < len(todo):
            end = padded_batch_end(todo, start, self.lengths, self.batch_tokens)
            out.update(self.features(todo[start:end]))
            start = end
        return out

    def _next_planned(self) -> list[int]:
        """The next planned samples whose right-padded batch fits ``batch_tokens`` (at least one)."""
        start = self._pos
        self._pos = padded_batch_end(self._plan, start, self.lengths, self.batch_tokens)
        return self._plan[start:self._pos]

    def features(self, indices: list[int]) -> dict[int, dict]:
        """Run the target once on these samples: {index: sample dict}."""
        todo = [self.samples[i] for i in indices]
        hidden, last = self.run_target(todo)
        out = {}
        for k, (i, s) in enumerate(zip(indices, todo)):
            d = {"input_ids": torch.from_numpy(s.input_ids).long(),
                 "loss_mask": torch.from_numpy(s.loss_mask).clone(), "hidden": hidden[k],
                 "sample_index": s.index}
            if last is not None:
                d["last_hidden"] = last[k]
            out[i] = d
        return out

    def run_target(self, todo: list) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The features of these samples, each its own [T, K*H] (and [T, H] final-norm output, or None), in
        FEATURE_DTYPE on the device: one right-padded forward through the hooked target."""
        from dflashkit.extract.data.batching import pad_batch

        ids, _ = pad_batch(todo, self.device)
        hidden, last_hidden = self.capture(ids)  # right padding: no mask needed (pad_batch)
        # one copy out of inference mode (autograd may save the features for backward), then per-sample views:
        # slicing by the known lengths never waits for the device
        hidden = hidden.to(FEATURE_DTYPE, copy=True)
        last_hidden = last_hidden.to(FEATURE_DTYPE, copy=True) if last_hidden is not None else None
        lengths = [len(s.input_ids) for s in todo]
        last = [last_hidden[k, :n] for k, n in enumerate(lengths)] if last_hidden is not None else None
        return [hidden[k, :n] for k, n in enumerate(lengths)], last


def open_online(cfg, device, compute_dtype: torch.dtype, say=print, rank: int = 0, parts: dict | None = None):
    """Load ``cfg.target`` and encode ``cfg.data``: (target, head, live manifest, samples). ``parts`` (a dict) gets
    the seconds of each: ``target_s``, ``data_s``.

    The live manifest holds what a shard manifest would (layer ids asked for, hidden size, layers, vocab) for
    ``build_model``; the caller then checks the drafter with ``check_drafter_matches_target`` and makes
    ``OnlineFeatures`` with the drafter's layer ids."""
    from dflashkit.targets.loading import load_target, load_target_head

    check_online_inputs(cfg)
    dtype = target_dtype(cfg, device)
    loading = time.perf_counter()
    target = load_target(cfg.target, dtype=dtype, device=device)
    target.model.requires_grad_(False).eval()
    # the training head shares the target's tensors when the dtypes agree, else it is read on its own
    head = target_head_of(target, dtype) if dtype == compute_dtype else \
        load_target_head(cfg.target, dtype=compute_dtype, device=device)
    return target, head, live_manifest(cfg, target), encode_online_data(cfg, target.tokenizer, say, rank, parts,
                                                                        loading)


def check_online_inputs(cfg) -> None:
    """What an online run needs before its target loads: a target, and records in the data."""
    from dflashkit.extract.data.sources import check_has_records

    if not cfg.target:
        raise UserError("target: online training (data=...) needs the target to run; pass --target (an HF "
                        "directory, a .gguf file or testbed:smollm2)")
    check_has_records(list(cfg.data))  # an empty data file stops here, before the target is loaded


def target_dtype(cfg, device) -> torch.dtype:
    """The dtype the target runs in: auto is the launch's default (bf16 on a GPU, fp32 on the CPU); train/config.py
    checked the name."""
    return launch.default_dtype(device, None if cfg.target_dtype == "auto" else cfg.target_dtype)


def chat_settings(cfg, manifest: dict | None) -> dict:
    """The chat template (its text; None: the target tokenizer's own) and kwargs the run's data was rendered
    with, as the export records them: the run's own settings when it encodes its data (``manifest`` None), else
    what the shard manifest records (only the kwargs from an extraction that predates its ``chat_template``)."""
    from dflashkit.extract.data.rendering import read_chat_template

    if manifest is None:
        return {"chat_template": read_chat_template(cfg.chat_template, flag="chat_template"),
                "chat_template_kwargs": dict(cfg.chat_template_kwargs)}
    recorded = {"chat_template_kwargs": manifest["template_kwargs"]} if "template_kwargs" in manifest else {}
    return {"chat_template": manifest["chat_template"], **recorded} if "chat_template" in manifest else recorded


def live_manifest(cfg, target) -> dict:
    """What a shard manifest would say of the live target (``target``: a loaded one, or a description)."""
    return {"target": target.identity(), "target_layer_ids": list(cfg.target_layer_ids) or None,
            "hidden_size": target.hidden_size, "num_target_layers": target.num_layers,
            "vocab_size": target.vocab_size, "mask_token_id": None}


def encode_online_data(cfg, tokenizer, say=print, rank: int = 0, parts: dict | None = None,
                       loading: float | None = None) -> list:
    """``cfg.data`` encoded as ``encode_data`` does, with the run's settings (token cache under output_dir).
    ``parts`` (a dict) gets its seconds as ``data_s``, and the target's as ``target_s``: from ``loading`` (when the
    target began to load) to now."""
    from dflashkit.extract.data.batching import resolve_tokenize_workers

    encoding = time.perf_counter()
    samples = encode_data(cfg.data, tokenizer, max_length=cfg.max_length, chat_template=cfg.chat_template,
                          template_kwargs=cfg.chat_template_kwargs, limit=cfg.data_limit or None,
                          tokenize_workers=resolve_tokenize_workers(cfg.tokenize_workers), say=say,
                          cache_dir=str(Path(cfg.output_dir) / "token-cache") if cfg.token_cache else None,
                          write_cache=rank == 0)
    if parts is not None:
        parts["data_s"] = time.perf_counter() - encoding
        if loading is not None:
            parts["target_s"] = encoding - loading
    return samples
