"""Training setup: the configuration -> the accelerator, the data (shards, or the live target: train/online.py),
the target's head, the drafter, the optimizer, the learning-rate schedule and the resumed position, gathered
in one ``TrainRun`` for the loop (train/trainer.py). The data and the target's head are built in
train/setup_data.py, the drafter, its optimizer and its kernels in train/setup_drafter.py; this file holds the
accelerator, the plan of the run, the schedule and the resume.

Design choices:
- accelerate drives the backend (single process, DDP, FSDP, DeepSpeed ZeRO-2/3, chosen by the accelerate
  config passed to ``accelerate launch``) and bf16 autocast; only the drafter and its optimizer are prepared.
  The target head stays outside: frozen, replicated on every rank, never sharded, never checkpointed.
- The drafter's initial weights depend on the seed alone: the seed is set again after the data and the target
  are loaded, whatever they consumed.
- The learning rate is a pure function of the step (``lr_at``: linear warmup, then cosine or linear decay to
  ``min_lr_ratio``): resuming needs only the step number.
- Online, the target runs in each training process (train/online.py) or, ``target_engine=vllm``, in a vLLM
  engine of the one process (train/online_vllm.py; ``vllm_api``: the installed vLLM unless a caller, a test,
  gives another); either way the dataset hands the trainer the same samples and features.
- Every check that can refuse the run (shards, manifest against drafter and target, loss against the data)
  runs here, before the first step; what can be checked before the target and the data load (the run
  directory, the checkpoint to resume, the init_from drafter) is checked before setup (train/run_dir.py).
- A resumed checkpoint must fit the run: its drafter's shape-defining fields, optimizer groups and position
  within this run's epochs, and its data (train/data_fingerprint.py, checked in train/run_dir.py before the target
  loads); else one line names the field.
- ``max_steps`` shorter than the epochs is announced at start (and recorded in summary.json).
- A DFlash2 drafter trained with ``selector_loss_weight=0`` keeps its selector as initialised: those
  parameters are frozen before the backend wraps the drafter, so no pass computes the selector's scores and
  DDP waits for no gradient of them.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflashkit.drafter.kinds import drafter_kind
from dflashkit.errors import UserError

from .checkpoint import load_checkpoint
from .config import TrainConfig
from .data import epoch_order, pack_order, split_indices, steps_per_epoch
from .data_fingerprint import data_fingerprint
from .drafter_pass import PassOptions
from .pass_options import term_reads_last_hidden
from .run_dir import ResumePoint, Start
from .setup_data import check_last_hidden, load_data_and_drafter
from .setup_drafter import prepare_drafter

# drafter fields (config.json names) a resumed checkpoint must share with the run's drafter
RESUME_DRAFTER_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
                         "target_layer_ids", "mask_token_id", "layer_types", "sliding_window", "is_causal")


def lr_at(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier on the peak lr for optimizer step ``step`` (0-based): linear warmup, then ``schedule``
    ("cosine" or "linear") from 1 down to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - min(1.0, progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


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


def configure_deepspeed(accelerator, cfg: TrainConfig) -> None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    c = plugin.deepspeed_config
    c["train_micro_batch_size_per_gpu"] = 1
    c["gradient_accumulation_steps"] = cfg.grad_accum
    c["train_batch_size"] = accelerator.num_processes * cfg.grad_accum
    c["gradient_clipping"] = cfg.max_grad_norm
    c.setdefault("zero_allow_untested_optimizer", True)


@dataclass
class TrainRun:
    """Everything the loop needs, built by ``setup``; ``step``, ``epoch`` and ``done`` are its position."""

    cfg: TrainConfig
    accelerator: object  # accelerate.Accelerator
    dataset: object  # ShardDataset, or online.OnlineFeatures (the target runs in the loop)
    head: object  # the target's frozen embedding / norm / lm_head (targets/loading.TargetHead)
    model: torch.nn.Module  # the drafter, prepared by accelerate
    dcfg: object  # its DrafterConfig
    optimizer: torch.optim.Optimizer  # prepared by accelerate
    train_idx: list  # training sample indices
    eval_idx: list  # held-out sample indices
    packs: list  # per epoch, its micro-batches (lists of sample indices) in order
    planned: int  # optimizer steps of all epochs
    total_steps: int  # the steps this run trains (planned, or max_steps when shorter)
    warmup: int  # warmup steps of the schedule
    pass_options: PassOptions  # the drafter pass's fixed arguments (train/drafter_pass.forward_blocks)
    use_last_hidden: bool  # the samples carry the target's final hidden states (kl loss, target_argmax labels)
    online: bool  # features come from the target in the loop
    data: dict = field(default_factory=dict)  # the data's fingerprint, kept in checkpoints (train/data_fingerprint.py)
    resumed_from: Path | None = None  # the checkpoint the run resumed from
    last_saved: Path | None = None  # the run's newest checkpoint on disk (resumed from or written): finite
    saved_step: int = -1  # the step of last_saved
    nonfinite: torch.Tensor | None = None  # the last step's NaN/Inf flags, read by the next collective (train_step)
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch
    done: int = 0  # micro-batches of the current epoch consumed (all ranks)
    startup: dict = field(default_factory=dict)  # where the start-up's seconds went (trainer.report_startup)
    chat: dict = field(default_factory=dict)  # the chat settings the data was rendered with (online.chat_settings)

    def lr_factor(self) -> float:
        """The schedule's multiplier on the peak lr for the next step."""
        c = self.cfg
        return lr_at(self.step, self.total_steps, self.warmup, c.min_lr_ratio, c.lr_schedule)

    def trainer_state(self) -> dict:
        """What a checkpoint records of the run besides the weights and the optimizer (train/checkpoint.py)."""
        return {"step": self.step, "epoch": self.epoch, "epoch_samples_done": self.done,
                "samples_per_step": self.accelerator.num_processes * self.cfg.grad_accum,
                "config": self.cfg.to_dict(), "drafter_config": self.dcfg.to_json_dict(), "chat": self.chat,
                "data": self.data}


def setup(cfg: TrainConfig, start: Start, resources: ExitStack, vllm_api=None) -> TrainRun:
    """Build the run ``cfg`` describes from ``start`` (train/run_dir.start_of_run: the checkpoint it resumes and
    the init_from drafter, both already checked); what the run holds open (an online run's capture hooks or vLLM
    engine) is entered on ``resources``, the trainer's ExitStack. ``vllm_api``: the vLLM calls of a
    ``target_engine=vllm`` run (targets/vllm/api.py ``VllmApi``; None: the installed vLLM)."""
    from accelerate.utils import set_seed

    from .online_vllm import engine_api

    # --- accelerator ------------------------------------------------------------------------------------
    online = bool(cfg.data)  # the target runs in the loop (train/online.py) instead of shards being read
    if not cfg.shards and not online:
        raise UserError("shards: no shard directory given; pass shards=DIR (a directory `dflashkit extract` "
                        "wrote), or --target T --data FILE to train online")
    accelerator = make_accelerator(cfg)
    configure_deepspeed(accelerator, cfg)
    vllm_api = engine_api(cfg, vllm_api, accelerator.num_processes)  # one process; a missing vLLM: one line, now
    set_seed(cfg.seed)

    # --- data, target head, drafter -----------------------------------------------------------------------
    # the target's final hidden states: kl, target_argmax labels, a kind's term on the target's distribution
    use_last_hidden = (cfg.loss == "kl" or cfg.labels == "target_argmax"
                       or term_reads_last_hidden(cfg, cfg.drafter_architecture))
    loading, parts = time.perf_counter(), {}
    dataset, head, model, dcfg = load_data_and_drafter(cfg, start, accelerator, resources, use_last_hidden,
                                                       vllm_api, parts)
    load_s = time.perf_counter() - loading
    check_last_hidden(cfg, dataset)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing = True
    selector = cfg.selector_loss_weight > 0
    frozen_selector = None if selector else drafter_kind(model).selector_of(model)  # DFlash2 without its term
    if frozen_selector is not None:
        frozen_selector.requires_grad_(False)

    # --- the order of the data and the length of the run ------------------------------------------------
    world = accelerator.num_processes
    train_idx, eval_idx = split_indices(len(dataset), cfg.eval_samples, cfg.seed,
                                        source=", ".join(map(str, cfg.data)) if online else cfg.shards)
    packs = [pack_order(epoch_order(train_idx, cfg.seed, e), dataset.lengths, cfg.micro_batch_tokens, cfg.max_length)
             for e in range(cfg.epochs)]  # the micro-batches of each epoch (lists of samples)
    planned = sum(steps_per_epoch(len(p), world, cfg.grad_accum) for p in packs)
    total_steps = min(planned, cfg.max_steps) if cfg.max_steps else planned
    backend_name = backend_of(accelerator)
    announce_plan(cfg, accelerator, backend_name, online, len(train_idx), len(eval_idx), packs, planned,
                  total_steps, dataset.lengths)

    # --- optimizer, backend -------------------------------------------------------------------------------
    from .online import chat_settings

    model, optimizer, pass_options = prepare_drafter(cfg, accelerator, model, dcfg, backend_name, selector)
    run = TrainRun(cfg=cfg, accelerator=accelerator, dataset=dataset, head=head, model=model, dcfg=dcfg,
                   optimizer=optimizer, train_idx=train_idx, eval_idx=eval_idx, packs=packs, planned=planned,
                   total_steps=total_steps, warmup=int(round(cfg.warmup_ratio * total_steps)),
                   pass_options=pass_options, use_last_hidden=use_last_hidden, online=online,
                   data=start.data or data_fingerprint(cfg, getattr(dataset, "manifest", None)),
                   startup={"load_s": load_s, **parts},
                   chat=chat_settings(cfg, None if online else dataset.manifest))

    # --- resume -------------------------------------------------------------------------------------------
    if start.resume is not None:
        resume(run, start.resume)
    return run


def backend_of(accelerator) -> str:
    """The backend accelerate runs (``DistributedType``'s name), with a note when it is not the FSDP asked for."""
    backend_name = str(accelerator.distributed_type).split(".")[-1]
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and backend_name != "FSDP":
        accelerator.print(f"note: the accelerate config asks for FSDP, but accelerate runs it as {backend_name} on "
                          f"{accelerator.device.type} (it shards only on GPUs): every process holds the whole "
                          f"drafter")
    return backend_name


def micro_batch_size(cfg: TrainConfig, micro_batches: list[list[int]], lengths) -> str:
    """What a micro-batch holds, as the plan says it: a sample longer than ``micro_batch_tokens`` gets one of its
    own (``pack_order``), so the bound is said only where it holds, with the longest where it does not."""
    if not cfg.micro_batch_tokens:
        return "one sequence each"
    longest = max((sum(min(int(lengths[i]), cfg.max_length or int(lengths[i])) for i in mb) for mb in micro_batches),
                  default=0)
    if longest <= cfg.micro_batch_tokens:
        return f"<= {cfg.micro_batch_tokens} tokens each"
    return f"<= {cfg.micro_batch_tokens} tokens each, a longer sample alone: up to {longest}"


def announce_plan(cfg: TrainConfig, accelerator, backend_name: str, online: bool, train_samples: int,
                  eval_samples: int, packs: list, planned: int, total_steps: int, lengths) -> None:
    """The run's plan in one line; a note when max_steps stops it before the last epoch ends."""
    world, G = accelerator.num_processes, cfg.grad_accum
    spe = steps_per_epoch(len(packs[0]), world, G)
    where = ("online, target in vLLM, " if cfg.target_engine == "vllm" else "online, ") if online else ""
    accelerator.print(
        f"dflashkit train ({backend_name}, {accelerator.device.type}): {where}"
        f"{train_samples} training / {eval_samples} "
        f"held-out samples, {world} process(es) x "
        f"{G} micro-batches ({micro_batch_size(cfg, packs[0], lengths)}) per step, "
        f"{spe} steps in epoch 0, {cfg.epochs} epochs = "
        f"{planned} steps")
    if total_steps < planned:
        accelerator.print(f"NOTE: max_steps={cfg.max_steps} stops training after {total_steps} of {planned} steps "
                          f"({total_steps / spe:.2f} of {cfg.epochs} epochs)")


def resume(run: TrainRun, point: ResumePoint) -> None:
    """Load ``point`` into the run (weights, optimizer, RNG) and take its position; refuse a checkpoint whose
    drafter differs from this run's or whose position is outside this run's epochs."""
    cfg, source = run.cfg, point.path / "trainer.json"
    saved, current = point.state["drafter_config"], run.dcfg.to_json_dict()
    differ = [f"{k} {saved[k]} (this run: {current[k]})" for k in RESUME_DRAFTER_FIELDS
              if k in saved and k in current and saved[k] != current[k]]
    if differ:
        raise UserError(f"{source}: the checkpoint's drafter has {', '.join(differ)}; resume with the settings it "
                        f"was written with, or start a new run in another output_dir")
    epoch, done = point.state["epoch"], point.state["epoch_samples_done"]
    if epoch < cfg.epochs and done >= len(run.packs[epoch]):
        raise UserError(f"{source}: field epoch_samples_done is {done}, but epoch {epoch} of this run has "
                        f"{len(run.packs[epoch])} micro-batches; resume with the data and settings the checkpoint "
                        f"was written with, or use another checkpoint")
    load_checkpoint(point.path, run.accelerator, run.model, run.optimizer, verified=True)
    run.step, run.epoch, run.done = point.state["step"], epoch, done
    run.resumed_from = run.last_saved = point.path
    run.saved_step = run.step
    run.accelerator.print(f"resumed from {point.path} (step {run.step}, epoch {run.epoch}, {run.done} micro-batches "
                          f"into the epoch)")
