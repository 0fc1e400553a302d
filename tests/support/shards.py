"""Feature shards of the tiny training target (support/tiny_targets.py: make_tiny_target), written with the real
shard writer: the input of the offline training tests."""

from pathlib import Path

import torch
import transformers as tf

SHARD_LAYER_IDS = [0, 2]  # the taps make_shards stores


def make_shards(path: Path, target_dir: Path, num_samples: int = 12, lengths=(24, 40), seed: int = 0,
                last_hidden: bool = True, repeat_first: bool = False, shard_size: int = 1 << 14) -> Path:
    """Features of random token sequences through the tiny target, written with the real shard writer.

    loss_mask: a short "prompt" (False) then the "answer" (True). repeat_first: every sample = sample 0.
    """
    from dflashkit.extract.shards.manifest import SCHEMA_VERSION, update_totals, write_manifest
    from dflashkit.extract.shards.writer import ShardWriter
    from dflashkit.targets.loading import identity_of

    target = tf.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = target.config
    manifest = {"schema_version": SCHEMA_VERSION, "format": "dflashkit-shards", "complete": False,
                "target": identity_of(Path(target_dir), str(target_dir)), "target_layer_ids": SHARD_LAYER_IDS,
                "num_target_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size, "feature_dim": len(SHARD_LAYER_IDS) * cfg.hidden_size, "codec": "bf16",
                "store_last_hidden": last_hidden, "skipped": {}, "notes": {}, "shards": []}
    writer = ShardWriter(path, manifest, shard_bytes=shard_size)
    g = torch.Generator().manual_seed(seed)
    first = None
    for i in range(num_samples):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size - 1, (n,), generator=g)  # the last id stays free for MASK
        mask = torch.zeros(n, dtype=torch.bool)
        mask[int(torch.randint(2, 6, (1,), generator=g)):] = True
        if repeat_first:
            first = first or (ids, mask)
            ids, mask = first
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
        hidden = torch.cat([hs[i + 1][0] for i in SHARD_LAYER_IDS], dim=-1)
        writer.add_batch([i], [len(ids)], ids.tolist(), mask.tolist(), hidden, hs[-1][0] if last_hidden else None)
    manifest = writer.close()
    manifest["complete"] = True
    update_totals(manifest)
    write_manifest(Path(path) / "manifest.json", manifest)
    return Path(path)
