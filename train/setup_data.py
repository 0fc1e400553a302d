"""Training setup, the data's part: the samples (feature shards, or the live target's features: train/online.py,
train/online_vllm.py), the target's frozen head, and the drafter built for them, every one checked against the
others before the first step (damaged shards, the manifest against the drafter and the target, the loss against
the data); train/setup.py gathers them into the run.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch

from dflashkit.errors import UserError

from .config import TrainConfig
from .pass_options import term_reads_last_hidden
from .run_dir import Start
from .setup_drafter import build_model


def verify_shards(shard_dir: str, rank: int, world: int) -> None:
    """Refuse to train on damaged shards: each rank checks every world-th shard (size, sha256, layout, NaN)."""
    from dflashkit.extract.shards.manifest import read_manifest, shard_path
    from dflashkit.extract.shards.verify import check_shard

    manifest = read_manifest(shard_dir)  # a malformed manifest, or a shard named outside shard_dir: one line
    files = [shard_path(shard_dir, entry, k) for k, entry in enumerate(manifest["shards"])]  # every rank: all stop
    problems = []
    for k in range(rank, len(files), world):
        problems += [f"{files[k]}: {p}" for p in check_shard(files[k], manifest["shards"][k], manifest)]
    if problems:
        # one line: the first problem in full, the rest counted (`dflashkit verify` lists every one)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"refusing to train on damaged shards: {problems[0]}{more}; `dflashkit verify {shard_dir}` "
                        "lists every problem; run the `dflashkit extract` that wrote them again with --overwrite "
                        "(--resume keeps the shards it lists, damaged or not)")


def target_identity(head) -> dict:
    """What to compare with the manifest's target: the config; the weight files for an HF directory (a GGUF
    target is converted per dtype, so its converted files differ between dtypes); the tokenizer when the
    target directory has one."""
    ident = head.identity()
    if str(head.path).startswith("testbed:") or str(head.path).endswith(".gguf"):
        ident.pop("weights_hash", None)
    if any((Path(head.model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        from dflashkit.extract.data.chat import tokenizer_hash

        ident["tokenizer_hash"] = tokenizer_hash(AutoTokenizer.from_pretrained(head.model_dir))
    return ident


def check_last_hidden(cfg: TrainConfig, dataset) -> None:
    """loss=kl and labels=target_argmax read the target's final hidden states: the data must carry them."""
    if cfg.loss == "kl" and not dataset.has_last_hidden:
        raise UserError(f"loss=kl needs last_hidden in the shards of {cfg.shards}; re-extract them with "
                        f"--store-last-hidden, or use loss=dpace (the default) or ce")
    if term_reads_last_hidden(cfg, cfg.drafter_architecture) and not dataset.has_last_hidden:
        raise UserError(f"drafter_architecture={cfg.drafter_architecture} trains on the target's distribution and "
                        f"needs last_hidden in the shards of {cfg.shards}; re-extract them with --store-last-hidden, "
                        f"or train online (--target T --data FILE)")
    if cfg.labels == "target_argmax" and not dataset.has_last_hidden:
        raise UserError(f"labels=target_argmax needs last_hidden in the shards of {cfg.shards}; re-extract them "
                        f"with --store-last-hidden, train online (--target T --data FILE), or use labels=data")


def load_data_and_drafter(cfg: TrainConfig, start: Start, accelerator, resources: ExitStack,
                          use_last_hidden: bool, vllm_api=None, parts: dict | None = None):
    """(dataset, head, model, DrafterConfig): the samples (shards, or the live target's features: train/online.py,
    train/online_vllm.py), the target's frozen head, and the drafter (new, seeded by ``cfg.seed`` alone, or
    ``start``'s init_from one), checked against the shards' manifest or the live target. ``parts`` (a dict) gets
    the seconds of each: ``data_s``, ``target_s``, ``drafter_s``."""
    from accelerate.utils import set_seed

    from dflashkit.extract.shards.manifest import check_manifest_matches
    from dflashkit.extract.shards.reader import ShardDataset
    from dflashkit.targets.loading import load_target_head

    compute_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    parts = {} if parts is None else parts
    if cfg.data and vllm_api is not None:  # online, the target in a vLLM engine: only described here
        from .online_vllm import open_online_vllm

        target, head, manifest, samples = open_online_vllm(cfg, device, compute_dtype, accelerator.print, rank,
                                                           parts)
    elif cfg.data:  # online: each rank loads its own frozen target; accelerate never sees it
        from .online import open_online

        target, head, manifest, samples = open_online(cfg, device, compute_dtype, accelerator.print, rank, parts)
    else:
        reading = time.perf_counter()
        if cfg.verify_shards:
            verify_shards(cfg.shards, rank, world)
        dataset = ShardDataset(cfg.shards)
        manifest = dataset.manifest
        read = time.perf_counter()
        head = load_target_head(cfg.target or manifest["target"]["path"], dtype=compute_dtype, device=device)
        parts.update(data_s=read - reading, target_s=time.perf_counter() - read)
    building = time.perf_counter()
    set_seed(cfg.seed)  # the drafter's initial weights depend on the seed alone, whatever loading consumed
    model, dcfg = build_model(cfg, manifest, head, start.init_model)
    if cfg.data:
        dataset = resources.enter_context(online_features(cfg, target, samples, dcfg, use_last_hidden, device,
                                                          vllm_api))
    else:
        check_manifest_matches(manifest, dcfg, target_identity(head))
    parts["drafter_s"] = time.perf_counter() - building
    return dataset, head, model, dcfg


def online_features(cfg: TrainConfig, target, samples: list, dcfg, use_last_hidden: bool, device, vllm_api):
    """The online dataset (not yet entered) for the drafter ``dcfg``, checked against the live target: the target
    of this process behind capture hooks, or (``vllm_api`` given) a vLLM engine."""
    from .online import OnlineFeatures, check_drafter_matches_target

    check_drafter_matches_target(dcfg, target)
    if vllm_api is not None:
        from .online_vllm import VllmOnlineFeatures, capture_config

        return VllmOnlineFeatures(target, samples, dcfg.target_layer_ids, config=capture_config(cfg, device),
                                  api=vllm_api, batch_tokens=cfg.target_batch_tokens, device=device)
    return OnlineFeatures(target, samples, dcfg.target_layer_ids, store_last_hidden=use_last_hidden,
                          batch_tokens=cfg.target_batch_tokens, device=device)
