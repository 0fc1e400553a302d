"""Training runs of the tests: TrainConfig fields of a seconds-long CPU training (on the shards of
support/shards.py, or online on the chat run below), the same fields as command-line arguments, and the losses a
run logged."""

import json
from pathlib import Path

from .chat_data import chat_records, save_tiny_chat_target, write_jsonl


def tiny_overrides(shards, out, **kw) -> dict:
    """TrainConfig fields of a seconds-long CPU training on the shards of ``make_shards``."""
    base = dict(shards=str(shards), output_dir=str(out), mask_token_id=95, num_hidden_layers=2, block_size=4,
                num_anchors=8, eval_samples=2, eval_anchors=4, epochs=2, grad_accum=2, mixed_precision="no",
                wandb=False, save_every=2, keep_last=2, log_every=1, eval_every=0, num_workers=0, progress=False,
                drafter={"intermediate_size": 64}, micro_batch_tokens=0)  # one sequence per micro-batch
    base.update(kw)
    return base


def as_argv(fields: dict) -> list[str]:
    """TrainConfig fields as the ``key=value`` arguments of ``python -m dflashkit.train``."""
    return [f"{k}={json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v}" for k, v in fields.items()]


def train_losses(out, key: str = "train/loss") -> dict:
    """{step: value} of a logged metric (the training loss by default) of the run in ``out``."""
    from dflashkit.train.tracking import read_metrics

    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


# ----------------------------------------------------------------------------- the online chat run
ONLINE_LAYERS = [1, 3]  # the tiny chat target has 4 layers: 3 is L-1, read after the final norm on both paths
ONLINE_MAX_LENGTH = 160


def extract_chat_run(root: Path):
    """(tiny target with the testbed tokenizer, chat jsonl with two bad lines, shards extracted from it) under
    ``root``: the same samples for online training (target + data) and offline training (shards)."""
    from dflashkit.extract.__main__ import main as extract

    target = save_tiny_chat_target(root / "target")
    data = write_jsonl(root / "chats.jsonl", chat_records(14, seed=3), bad_lines={4: "{not json", 9: '{"x": 1}'})
    shards = root / "shards"
    # --bucket-window 1: shards hold the samples in record order, the order online training numbers them;
    # --batch-tokens 1: every sample runs alone through the target
    assert extract(["--target", target, "--data", data, "--out", str(shards), "--layer-ids", "1,3",
                    "--max-length", str(ONLINE_MAX_LENGTH), "--dtype", "float32", "--bucket-window", "1",
                    "--batch-tokens", "1", "--store-last-hidden", "--no-progress"]) == 0
    return target, data, shards


def online_overrides(out, **kw) -> dict:
    """TrainConfig fields of a short training on the chat run (give ``shards=`` or ``target=`` and ``data=``)."""
    base = dict(output_dir=str(out), mask_token_id=16, num_hidden_layers=2, block_size=4, num_anchors=8,
                target_layer_ids=ONLINE_LAYERS, eval_samples=2, eval_anchors=4, epochs=1, grad_accum=2,
                mixed_precision="no", wandb=False, save_every=2, keep_last=2, log_every=1, eval_every=2,
                num_workers=0, progress=False, max_length=ONLINE_MAX_LENGTH, drafter={"intermediate_size": 64},
                micro_batch_tokens=0)  # one sequence per micro-batch unless a test packs
    base.update(kw)
    return base


def later_checkpoint(run, step: int) -> Path:
    """What a training still running writes next into the run directory ``run``: checkpoint ``step`` (a copy of
    the newest with other weights, checkpoint.json to match), then the rotation (keep_last=1) that removes every
    older one. Returns the new step directory."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflashkit.files import sha256_file
    from dflashkit.train.checkpoint import list_checkpoints, rotate_checkpoints

    newest = list_checkpoints(run)[-1]
    later = newest.with_name(f"step-{step:08d}")
    shutil.copytree(newest, later)
    weights = {k: v + 1.0 for k, v in load_file(later / "model.safetensors").items()}
    save_file(weights, later / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((later / "checkpoint.json").read_text())
    meta["step"] = step
    meta["files"]["model.safetensors"] = {"bytes": (later / "model.safetensors").stat().st_size,
                                          "sha256": sha256_file(later / "model.safetensors")}
    (later / "checkpoint.json").write_text(json.dumps(meta))
    rotate_checkpoints(run, step, keep_last=1)
    return later
