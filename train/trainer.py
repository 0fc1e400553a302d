"""The training loop: features (from shards, or from the live target: train/online.py) + the target's
embedding/norm/lm_head + a drafter -> checkpoints -> an export.

Reads top to bottom: setup (accelerate, shards, target head, drafter, checks), optimizer and schedule,
resume, the loop (one optimizer step = G micro-batches per rank), evaluation, checkpoints, export.

Design choices:
- accelerate drives the backend (single process, DDP, FSDP, DeepSpeed ZeRO-2/3, chosen by the accelerate
  config passed to ``accelerate launch``) and bf16 autocast; only the drafter and its optimizer are prepared.
  The target head stays outside: frozen, replicated on every rank, never sharded, never checkpointed.
- Normalisation is global: before a step's forwards, every rank adds up the loss denominators of its G
  micro-batches (known from the anchors alone) and these are summed across ranks. Each micro-batch then
  back-propagates ``loss_sum * W * G / global_denominator`` (accelerate divides by G, DDP/ZeRO average over W),
  so the update equals the single-process one on the same samples.
- The learning rate is a pure function of the step (linear warmup, then cosine or linear decay to
  ``min_lr_ratio``), set on the optimizer before each step: resuming needs only the step number.
- ``max_steps`` shorter than the epochs is announced at start and recorded in summary.json.
- One run per ``output_dir``: it must be empty, a training run's, or ``overwrite=true``, and is locked while the
  run lives (ranks of one launch share the lock; dflashkit/outputs.py); ``export_dir`` is checked at start.
- SIGTERM / SIGINT (train/checkpoint.StopRequest): the ranks vote in the step's one collective, stop at the
  same step boundary, write a checkpoint there and return ``preempted`` (the command exits 0).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from dflashkit.extract.shards import pause_point

from .checkpoint import StopRequest, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import BlockSource, block_loader, epoch_order, pack_order, rank_slots, split_indices, steps_per_epoch
from .loss import loss_denominator
from .step import MetricSums, compile_layers, evaluate, forward_blocks, mask_backend
from .tracking import Tracker


def lr_at(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier on the peak lr for optimizer step ``step`` (0-based): linear warmup, then ``schedule``
    ("cosine" or "linear") from 1 down to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - min(1.0, progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def resolve_mask_token(cfg: TrainConfig, head) -> int:
    """cfg.mask_token_id, else the tokenizer's mask token or a spare row (the one resolver, targets/loading.py)."""
    from transformers import AutoTokenizer

    from dflashkit.targets.loading import resolve_mask_token_id

    tokenizer = None if cfg.mask_token_id is not None else AutoTokenizer.from_pretrained(head.model_dir)
    return resolve_mask_token_id(tokenizer, head.config, cfg.mask_token_id)


def build_model(cfg: TrainConfig, manifest: dict, head):
    """A new drafter sized for the target, or the one in ``init_from``; returns (model, DrafterConfig)."""
    from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter

    if cfg.init_from:
        model = load_drafter(cfg.init_from)
        if cfg.mask_token_id is not None and model.dflash.mask_token_id != cfg.mask_token_id:
            raise ValueError(f"mask_token_id={cfg.mask_token_id} but the drafter in {cfg.init_from} was trained with "
                             f"{model.dflash.mask_token_id}; drop mask_token_id to keep the drafter's")
        if model.dflash.architecture != cfg.drafter_architecture:
            raise ValueError(f"drafter_architecture={cfg.drafter_architecture} but the drafter in {cfg.init_from} is "
                             f"{model.dflash.architecture}; set drafter_architecture={model.dflash.architecture}")
        return model.train(), model.dflash
    dcfg = DrafterConfig.for_target(
        head.config, num_hidden_layers=cfg.num_hidden_layers, block_size=cfg.block_size,
        target_layer_ids=list(cfg.target_layer_ids or manifest.get("target_layer_ids") or []),
        mask_token_id=resolve_mask_token(cfg, head), layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window, input_embedding_scale=float(head.embedding_scale),
        architecture=cfg.drafter_architecture, **cfg.drafter)
    return build_drafter(dcfg).train(), dcfg


def make_accelerator(cfg: TrainConfig):
    """An Accelerator for the launch environment. On a machine without CUDA, accelerate forms a process group
    only when told: cpu=True for plain data parallelism (gloo), or the gloo backend named for DeepSpeed."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kw = dict(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.grad_accum)
    if not torch.cuda.is_available():
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            kw["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        else:
            kw["cpu"] = True
    return Accelerator(**kw)


def _configure_deepspeed(accelerator, cfg: TrainConfig) -> None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    c = plugin.deepspeed_config
    c["train_micro_batch_size_per_gpu"] = 1
    c["gradient_accumulation_steps"] = cfg.grad_accum
    c["train_batch_size"] = accelerator.num_processes * cfg.grad_accum
    c["gradient_clipping"] = cfg.max_grad_norm
    c.setdefault("zero_allow_untested_optimizer", True)


def verify_shards(shard_dir: str, rank: int, world: int) -> None:
    """Refuse to train on damaged shards: each rank checks every world-th shard (size, sha256, layout, NaN)."""
    from dflashkit.extract.shards import read_manifest, shard_path
    from dflashkit.extract.verify import check_shard

    manifest = read_manifest(shard_dir)  # a malformed manifest, or a shard named outside shard_dir: one line
    files = [shard_path(shard_dir, entry, k) for k, entry in enumerate(manifest["shards"])]  # every rank: all stop
    problems = []
    for k in range(rank, len(files), world):
        problems += [f"{files[k]}: {p}" for p in check_shard(files[k], manifest["shards"][k], manifest)]
    if problems:
        raise ValueError("refusing to train on damaged shards:\n  " + "\n  ".join(problems) +
                         f"\nre-extract them (`dflashkit verify {shard_dir}` lists every problem)")


def target_identity(head) -> dict:
    """What to compare with the manifest's target: the config; the weight files for an HF directory (a GGUF
    target is converted per dtype, so its converted files differ between dtypes); the tokenizer when the
    target directory has one."""
    ident = head.identity()
    if str(head.path).startswith("testbed:") or str(head.path).endswith(".gguf"):
        ident.pop("weights_hash", None)
    if any((Path(head.model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        from dflashkit.extract.chat import tokenizer_hash

        ident["tokenizer_hash"] = tokenizer_hash(AutoTokenizer.from_pretrained(head.model_dir))
    return ident


def _param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    from .muon import never_decayed

    for name, p in model.named_parameters():
        (no_decay if never_decayed(name, p) else decay).append(p)  # norms, DFlash2's base kernels
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


RUN_FILES = ("checkpoints", "export", "metrics.jsonl", "summary.json", "token-cache", "tb", "wandb", "wandb-run-id")


def check_output_paths(cfg: TrainConfig) -> Path:
    """Refuse, before any work, an output_dir that holds files of something else and an export_dir that is not a
    drafter export (unless ``overwrite``); a file at either path always. Returns the export directory."""
    from dflashkit.drafter.export import export_dir_problem
    from dflashkit.outputs import check_output_dir, describe_foreign, foreign_entries

    out_dir = Path(cfg.output_dir)
    export_dir = Path(cfg.export_dir or out_dir / "export")
    owned = {*RUN_FILES, export_dir.name} if export_dir.parent == out_dir else set(RUN_FILES)

    def run_dir_problem(path: Path) -> str | None:
        foreign = foreign_entries(path, lambda name: name in owned)
        return describe_foreign(foreign) if foreign else None

    check_output_dir(out_dir, what="a training run directory", problem=run_dir_problem, overwrite=cfg.overwrite,
                     flag="overwrite=true", forcing="write into it anyway")
    check_output_dir(export_dir, what="a drafter directory", problem=export_dir_problem, overwrite=cfg.overwrite,
                     flag="overwrite=true")
    return export_dir


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says (the module docstring), holding the lock on ``cfg.output_dir`` throughout."""
    from dflashkit.outputs import OutputLock

    check_output_paths(cfg)
    with OutputLock(cfg.output_dir, "train"):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict:
    from accelerate.utils import set_seed

    from dflashkit.extract.shards import ShardDataset, check_manifest_matches
    from dflashkit.targets.loading import load_target_head

    # --- setup --------------------------------------------------------------------------------------------
    online = bool(cfg.data)  # the target runs in the loop (train/online.py) instead of shards being read
    if not cfg.shards and not online:
        raise ValueError("shards: no shard directory given; pass shards=DIR (a directory `dflashkit extract` "
                         "wrote), or --target T --data FILE to train online")
    accelerator = make_accelerator(cfg)
    _configure_deepspeed(accelerator, cfg)
    say = accelerator.print
    world, rank, G = accelerator.num_processes, accelerator.process_index, cfg.grad_accum
    out_dir = Path(cfg.output_dir)
    set_seed(cfg.seed)
    compute_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    if online:  # each rank loads its own frozen target; accelerate never sees it
        from .online import OnlineFeatures, check_drafter_matches_target, open_online

        target, head, manifest, samples = open_online(cfg, accelerator.device, compute_dtype, say, rank)
    else:
        if cfg.verify_shards:
            verify_shards(cfg.shards, rank, world)
        dataset = ShardDataset(cfg.shards)
        manifest = dataset.manifest
        head_spec = cfg.target or manifest["target"]["path"]
        head = load_target_head(head_spec, dtype=compute_dtype, device=accelerator.device)
    set_seed(cfg.seed)  # the drafter's initial weights depend on the seed alone, whatever loading consumed
    model, dcfg = build_model(cfg, manifest, head)
    use_last_hidden = cfg.loss == "kl" or cfg.labels == "target_argmax"  # the target's final hidden states
    if online:
        check_drafter_matches_target(dcfg, target)
        dataset = OnlineFeatures(target, samples, dcfg.target_layer_ids, store_last_hidden=use_last_hidden,
                                 batch_tokens=cfg.target_batch_tokens, device=accelerator.device)
    else:
        check_manifest_matches(manifest, dcfg, target_identity(head))
    if cfg.loss == "kl" and not dataset.has_last_hidden:
        raise ValueError(f"loss=kl needs last_hidden in the shards of {cfg.shards}; re-extract them with "
                         f"--store-last-hidden, or use loss=dpace (the default) or ce")
    if cfg.labels == "target_argmax" and not dataset.has_last_hidden:
        raise ValueError(f"labels=target_argmax needs last_hidden in the shards of {cfg.shards}; re-extract them "
                         f"with --store-last-hidden, train online (--target T --data FILE), or use labels=data")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing = True
    train_idx, eval_idx = split_indices(len(dataset), cfg.eval_samples, cfg.seed)
    packs = [pack_order(epoch_order(train_idx, cfg.seed, e), dataset.lengths, cfg.micro_batch_tokens, cfg.max_length)
             for e in range(cfg.epochs)]  # the micro-batches of each epoch (lists of samples)
    spe = steps_per_epoch(len(packs[0]), world, G)
    planned = sum(steps_per_epoch(len(p), world, G) for p in packs)
    total_steps = min(planned, cfg.max_steps) if cfg.max_steps else planned
    warmup = int(round(cfg.warmup_ratio * total_steps))
    backend_name = str(accelerator.distributed_type).split(".")[-1]
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and backend_name != "FSDP":
        say(f"note: the accelerate config asks for FSDP, but accelerate runs it as {backend_name} on "
            f"{accelerator.device.type} (it shards only on GPUs): every process holds the whole drafter")
    say(f"dflashkit train ({backend_name}, {accelerator.device.type}): {'online, ' if online else ''}"
        f"{len(train_idx)} training / {len(eval_idx)} "
        f"held-out samples, {world} process(es) x "
        f"{G} micro-batches ({f'<= {cfg.micro_batch_tokens} tokens' if cfg.micro_batch_tokens else 'one sequence'} "
        f"each) per step, "
        f"{spe} steps in epoch 0, {cfg.epochs} epochs = "
        f"{planned} steps")
    if total_steps < planned:
        say(f"NOTE: max_steps={cfg.max_steps} stops training after {total_steps} of {planned} steps "
            f"({total_steps / spe:.2f} of {cfg.epochs} epochs)")

    # --- optimizer, backend -------------------------------------------------------------------------------
    if cfg.optimizer == "muon":  # train/muon.py: Muon on the 2-D matrices, AdamW on the rest
        from .muon import Muon, check_backend, muon_param_groups

        check_backend(backend_name)
        optimizer = Muon(muon_param_groups(model, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay),
                         lr=cfg.lr, momentum=cfg.muon_momentum, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
    else:
        optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                      betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
    model, optimizer = accelerator.prepare(model, optimizer)
    if cfg.compile:  # per decoder layer, dynamic shapes from the start (train/step.compile_layers)
        compile_layers(accelerator.unwrap_model(model))
    backend = mask_backend(cfg.attention, accelerator.device)
    say(f"attention mask: {backend}{' (compiled drafter layers)' if cfg.compile else ''}")
    common = dict(block_size=dcfg.block_size, layer_types=dcfg.layer_types, sliding_window=dcfg.sliding_window,
                  backend=backend, chunk_tokens=cfg.loss_chunk_tokens,
                  fused_loss=cfg.compile and accelerator.device.type == "cuda")  # compiled logit kernels

    # --- resume -------------------------------------------------------------------------------------------
    step, epoch, done = 0, 0, 0
    ckpt = None
    if cfg.resume == "auto":
        ckpt = latest_checkpoint(out_dir, warn=say)
    elif cfg.resume not in ("none", ""):
        ckpt = Path(cfg.resume)
    if ckpt is not None:
        state = load_checkpoint(ckpt, accelerator, model, optimizer)
        step, epoch, done = state["step"], state["epoch"], state["epoch_samples_done"]
        say(f"resumed from {ckpt} (step {step}, epoch {epoch}, {done} micro-batches into the epoch)")
    tracker = Tracker(out_dir, cfg.to_dict(), enabled=accelerator.is_main_process, wandb=cfg.wandb,
                      wandb_project=cfg.wandb_project, run_name=cfg.run_name, tensorboard=cfg.tensorboard,
                      resume_step=step)
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=step, disable=not (accelerator.is_main_process and cfg.progress),
               dynamic_ncols=True)
    last_eval: dict = {}

    def trainer_state() -> dict:
        return {"step": step, "epoch": epoch, "epoch_samples_done": done, "samples_per_step": world * G,
                "config": cfg.to_dict(), "drafter_config": dcfg.to_json_dict()}

    def run_eval() -> dict:
        if not eval_idx:
            return {}
        return evaluate(model, head, dataset, eval_idx, mask_token_id=dcfg.mask_token_id,
                        num_anchors=cfg.eval_anchors, seed=cfg.seed, gamma=cfg.gamma, max_length=cfg.max_length,
                        accelerator=accelerator, **common)

    # --- loop ---------------------------------------------------------------------------------------------
    model.train()
    sums, t0 = MetricSums(dcfg.block_size - 1, accelerator.device), time.perf_counter()
    saved_at = step if ckpt is not None else -1  # the step whose checkpoint is on disk
    stop = StopRequest().__enter__()  # SIGTERM / SIGINT: checkpoint at the next step boundary, then exit
    while step < total_steps and epoch < cfg.epochs and not stop.agreed:
        slots = rank_slots(packs[epoch], done, world, G, rank)
        if online:  # the target runs on this rank's samples in the order they are read
            dataset.plan([i for item, _ in slots for i in (item if isinstance(item, list) else [item])])
        source = BlockSource(dataset, slots, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                             num_anchors=cfg.num_anchors, seed=cfg.seed, epoch=epoch, max_length=cfg.max_length,
                             use_last_hidden=use_last_hidden, anchor_density=cfg.anchor_density)
        loader = block_loader(source, num_workers=0 if online else cfg.num_workers,
                              pin_memory=accelerator.device.type == "cuda" and not online)
        for _ in range(len(slots) // G):
            if step >= total_steps:
                break
            micro = [next(loader).to(accelerator.device, non_blocking=True) for _ in range(G)]
            factor = lr_at(step, total_steps, warmup, cfg.min_lr_ratio, cfg.lr_schedule)
            for group in optimizer.param_groups:  # Muon's groups carry their own peak lr (muon_lr)
                group["lr"] = group.get("base_lr", cfg.lr) * factor
            denoms = [loss_denominator(m.valid, cfg.loss, cfg.gamma) * m.scale for m in micro]
            # DFlash2's selector term is normalised by the decay-weighted count of valid labels (selector_loss.py)
            sel_denoms = [loss_denominator(m.valid, "ce", cfg.gamma) * m.scale for m in micro]
            # one collective: the global loss denominators and the ranks' votes to stop (all stop at the same step)
            votes = torch.stack([torch.stack(denoms).sum().float().to(accelerator.device),
                                 torch.tensor(float(stop.requested), device=accelerator.device),
                                 torch.stack(sel_denoms).sum().float().to(accelerator.device)])
            global_denom, stop_votes, global_sel_denom = accelerator.reduce(votes, reduction="sum")
            if stop_votes > 0:
                stop.agreed = True
                break
            grad_norm = None
            for m, d in zip(micro, denoms):
                with accelerator.accumulate(model):
                    out = forward_blocks(model, head, m, variant=cfg.loss, gamma=cfg.gamma,
                                         dpace_alpha=cfg.dpace_alpha, kl_weight=cfg.kl_weight, labels=cfg.labels,
                                         **common)
                    weight = m.scale * world * G / global_denom.clamp_min(1e-12)
                    loss = out.loss_sum * weight
                    if out.selector is not None:  # DFlash2: + selector_loss_weight * the selector term
                        loss = loss + out.selector.loss_sum * (cfg.selector_loss_weight * m.scale * world * G
                                                               / global_sel_denom.clamp_min(1e-12))
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if cfg.max_grad_norm > 0:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                sums.add(out, d, m.scale, m.num_tokens)
            step += 1
            done += world * G
            bar.update(1)
            # --- metrics, evaluation, checkpoints ----------------------------------------------------------
            if step % cfg.log_every == 0 or step == total_steps:
                metrics = sums.reduce(accelerator).metrics("train")
                dt = max(time.perf_counter() - t0, 1e-9)
                metrics.update({"lr": cfg.lr * factor, "epoch": epoch + done / len(packs[epoch]),
                                "tokens_per_s": sums.tokens / dt})
                if grad_norm is None and hasattr(model, "get_global_grad_norm"):
                    grad_norm = model.get_global_grad_norm()
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                tracker.log(metrics, step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}",
                                tau_sim=f"{last_eval.get('eval/tau_sim', float('nan')):.2f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                sums, t0 = MetricSums(dcfg.block_size - 1, accelerator.device), time.perf_counter()
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                last_eval = run_eval()
                tracker.log(last_eval, step)
            if done >= len(packs[epoch]):
                epoch, done = epoch + 1, 0
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(accelerator, model, optimizer, trainer_state(), out_dir, cfg.keep_last)
                saved_at = step
            pause_point(f"step-{step}-done", until=lambda: stop.requested)  # test hook; returns on a stop request
    bar.close()
    stop.__exit__()
    if stop.agreed:  # preempted: keep the step, leave the run unfinished
        final = save_checkpoint(accelerator, model, optimizer, trainer_state(), out_dir, cfg.keep_last) \
            if saved_at != step else out_dir / "checkpoints" / f"step-{step:08d}"
        if accelerator.is_main_process:
            print(f"dflashkit train: stopped by {stop.signal_name or 'a signal on another rank'} at step {step} of "
                  f"{total_steps}; checkpoint {final} written. Resume with the same command (resume=auto, the "
                  f"default); `dflashkit export {final} DIR` exports it as it is.", file=sys.stderr, flush=True)
        tracker.close()
        accelerator.wait_for_everyone()
        return {"step": step, "planned_steps": planned, "preempted": True, "checkpoint": str(final)}

    # --- final evaluation, checkpoint and export ----------------------------------------------------------
    last_eval = run_eval()
    tracker.log(last_eval, step)
    final = save_checkpoint(accelerator, model, optimizer, trainer_state(), out_dir, cfg.keep_last) \
        if saved_at != step else out_dir / "checkpoints" / f"step-{step:08d}"
    export_dir = Path(cfg.export_dir or out_dir / "export")
    if accelerator.is_main_process:
        from .export import export_checkpoint

        export_checkpoint(final, export_dir, overwrite=cfg.overwrite, flag="overwrite=true")
    summary = {"step": step, "planned_steps": planned, "stopped_by_max_steps": total_steps < planned,
               "epochs_completed": epoch, "checkpoint": str(final), "export_dir": str(export_dir), **last_eval}
    if accelerator.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        say(json.dumps(summary))
    tracker.close()
    accelerator.wait_for_everyone()
    return summary
