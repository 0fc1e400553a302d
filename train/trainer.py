"""The training loop: features (from shards, or from the live target: train/online.py) + the target's
embedding/norm/lm_head + a drafter -> checkpoints -> an export.

Reads in three parts, as the modules it calls:
- setup (train/setup.py): the configuration -> accelerator, data, target head, drafter, optimizer, schedule and
  the resumed position, one ``TrainRun``;
- the loop: one ``train_step`` per optimizer step (train/train_step.py: the step's G micro-batches per rank
  forward and backward through the drafter pass of train/drafter_pass.py, the optimizer and lr step, the ranks'
  vote to stop), then the log line, the periodic held-out eval (train/evaluate.py) and checkpoint;
- eval and save: the final held-out eval, checkpoint (train/checkpoint.py) and export (train/export.py), and
  summary.json.

Design choices:
- ``max_steps`` shorter than the epochs is announced at start and recorded in summary.json.
- One run per ``output_dir``: it must be empty, a training run's, or ``overwrite=true``, and is locked while the
  run lives (ranks of one launch share the lock; dflashkit/outputs.py); ``export_dir`` is checked at start.
- SIGTERM / SIGINT (dflashkit/stopping.StopRequest): the ranks vote in the step's one collective, stop at the
  same step boundary, write a checkpoint there and return ``preempted`` (the command exits 0).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflashkit.files import pause_point
from dflashkit.stopping import StopRequest

from .checkpoint import save_checkpoint
from .config import TrainConfig
from .data import BlockSource, block_loader, rank_slots
from .evaluate import evaluate
from .metrics import MetricSums
from .setup import TrainRun, check_output_paths, setup
from .tracking import Tracker
from .train_step import train_step


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says (the module docstring), holding the lock on ``cfg.output_dir`` throughout."""
    from dflashkit.outputs import OutputLock

    check_output_paths(cfg)
    with OutputLock(cfg.output_dir, "train"):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict:
    # --- setup: data, target head, drafter, optimizer, schedule, resume (train/setup.py) -----------------
    run = setup(cfg)
    accelerator = run.accelerator
    out_dir = Path(cfg.output_dir)
    tracker = Tracker(out_dir, cfg.to_dict(), enabled=accelerator.is_main_process, wandb=cfg.wandb,
                      wandb_project=cfg.wandb_project, run_name=cfg.run_name, tensorboard=cfg.tensorboard,
                      resume_step=run.step)
    from tqdm.auto import tqdm

    bar = tqdm(total=run.total_steps, initial=run.step,
               disable=not (accelerator.is_main_process and cfg.progress), dynamic_ncols=True)

    # --- the loop: one train_step per optimizer step (train/train_step.py) -------------------------------
    world, G = accelerator.num_processes, cfg.grad_accum
    run.model.train()
    sums, t0 = MetricSums(run.dcfg.block_size - 1, accelerator.device), time.perf_counter()
    last_eval: dict = {}
    saved_at = run.step if run.resumed_from is not None else -1  # the step whose checkpoint is on disk
    stop = StopRequest().__enter__()  # SIGTERM / SIGINT: checkpoint at the next step boundary, then exit
    while run.step < run.total_steps and run.epoch < cfg.epochs and not stop.agreed:
        batches, steps_left = epoch_batches(run)
        for _ in range(steps_left):
            if run.step >= run.total_steps:
                break
            micro = [next(batches).to(accelerator.device, non_blocking=True) for _ in range(G)]
            factor = run.lr_factor()
            result = train_step(run.model, run.optimizer, accelerator, run.head, micro, cfg=cfg, lr_factor=factor,
                                stop_requested=stop.requested, sums=sums, pass_options=run.pass_options)
            if result.stopped:
                stop.agreed = True
                break
            run.step += 1
            run.done += world * G
            bar.update(1)
            # --- metrics, evaluation, checkpoints ----------------------------------------------------------
            if run.step % cfg.log_every == 0 or run.step == run.total_steps:
                metrics = train_metrics(run, sums, factor, result.grad_norm, time.perf_counter() - t0)
                tracker.log(metrics, run.step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}",
                                tau_sim=f"{last_eval.get('eval/tau_sim', float('nan')):.2f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                sums, t0 = MetricSums(run.dcfg.block_size - 1, accelerator.device), time.perf_counter()
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < run.total_steps:
                last_eval = held_out_eval(run)
                tracker.log(last_eval, run.step)
            if run.done >= len(run.packs[run.epoch]):
                run.epoch, run.done = run.epoch + 1, 0
            if cfg.save_every and run.step % cfg.save_every == 0:
                save_checkpoint(accelerator, run.model, run.optimizer, run.trainer_state(), out_dir, cfg.keep_last)
                saved_at = run.step
            pause_point(f"step-{run.step}-done", until=lambda: stop.requested)  # test hook; returns on a stop
    bar.close()
    stop.__exit__()

    # --- eval and save: preempted, the checkpoint alone; else the final eval, checkpoint and export ------
    if stop.agreed:  # preempted: keep the step, leave the run unfinished
        final = save_final(run, saved_at)
        if accelerator.is_main_process:
            print(f"dflashkit train: stopped by {stop.signal_name or 'a signal on another rank'} at step {run.step} "
                  f"of {run.total_steps}; checkpoint {final} written. Resume with the same command (resume=auto, "
                  f"the default); `dflashkit export {final} DIR` exports it as it is.", file=sys.stderr, flush=True)
        tracker.close()
        accelerator.wait_for_everyone()
        return {"step": run.step, "planned_steps": run.planned, "preempted": True, "checkpoint": str(final)}
    last_eval = held_out_eval(run)
    tracker.log(last_eval, run.step)
    summary = export_and_summarise(run, save_final(run, saved_at), last_eval)
    tracker.close()
    accelerator.wait_for_everyone()
    return summary


def epoch_batches(run: TrainRun):
    """This rank's micro-batches from the run's position to the end of its epoch, and the steps they make."""
    cfg, accelerator = run.cfg, run.accelerator
    slots = rank_slots(run.packs[run.epoch], run.done, accelerator.num_processes, cfg.grad_accum,
                       accelerator.process_index)
    if run.online:  # the target runs on this rank's samples in the order they are read
        run.dataset.plan([i for item, _ in slots for i in (item if isinstance(item, list) else [item])])
    source = BlockSource(run.dataset, slots, block_size=run.dcfg.block_size, mask_token_id=run.dcfg.mask_token_id,
                         num_anchors=cfg.num_anchors, seed=cfg.seed, epoch=run.epoch, max_length=cfg.max_length,
                         use_last_hidden=run.use_last_hidden, anchor_density=cfg.anchor_density)
    loader = block_loader(source, num_workers=0 if run.online else cfg.num_workers,
                          pin_memory=accelerator.device.type == "cuda" and not run.online)
    return loader, len(slots) // cfg.grad_accum


def train_metrics(run: TrainRun, sums: MetricSums, lr_factor: float, grad_norm, seconds: float) -> dict:
    """The log line of the steps since the last one: their metrics reduced across ranks, lr, epoch, speed."""
    metrics = sums.reduce(run.accelerator).metrics("train")
    metrics.update({"lr": run.cfg.lr * lr_factor, "epoch": run.epoch + run.done / len(run.packs[run.epoch]),
                    "tokens_per_s": sums.tokens / max(seconds, 1e-9)})
    if grad_norm is None and hasattr(run.model, "get_global_grad_norm"):  # DeepSpeed clips itself
        grad_norm = run.model.get_global_grad_norm()
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


def held_out_eval(run: TrainRun) -> dict:
    """The held-out metrics of the drafter as it is now (train/evaluate.py); {} without held-out samples."""
    if not run.eval_idx:
        return {}
    cfg = run.cfg
    return evaluate(run.model, run.head, run.dataset, run.eval_idx, mask_token_id=run.dcfg.mask_token_id,
                    num_anchors=cfg.eval_anchors, seed=cfg.seed, gamma=cfg.gamma, max_length=cfg.max_length,
                    accelerator=run.accelerator, **run.pass_options)


def save_final(run: TrainRun, saved_at: int) -> Path:
    """The checkpoint of the run's current step: written unless it is already on disk (``saved_at``)."""
    out_dir = Path(run.cfg.output_dir)
    if saved_at == run.step:
        return out_dir / "checkpoints" / f"step-{run.step:08d}"
    return save_checkpoint(run.accelerator, run.model, run.optimizer, run.trainer_state(), out_dir,
                           run.cfg.keep_last)


def export_and_summarise(run: TrainRun, final: Path, last_eval: dict) -> dict:
    """Export the final checkpoint (rank 0) and write summary.json."""
    cfg, accelerator = run.cfg, run.accelerator
    out_dir = Path(cfg.output_dir)
    export_dir = Path(cfg.export_dir or out_dir / "export")
    if accelerator.is_main_process:
        from .export import export_checkpoint

        export_checkpoint(final, export_dir, overwrite=cfg.overwrite, flag="overwrite=true")
    summary = {"step": run.step, "planned_steps": run.planned, "stopped_by_max_steps": run.total_steps < run.planned,
               "epochs_completed": run.epoch, "checkpoint": str(final), "export_dir": str(export_dir), **last_eval}
    if accelerator.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        accelerator.print(json.dumps(summary))
    return summary
