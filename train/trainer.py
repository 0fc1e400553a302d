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
  run lives (ranks of one launch share the lock; dflashkit/outputs.py); ``export_dir`` is checked at start; a
  new run (``resume=none``) never shares a directory with an earlier one, and the checkpoint to resume is found
  and checked before the target loads (train/run_dir.py).
- SIGTERM / SIGINT (dflashkit/stopping.StopRequest): the ranks vote in the step's one collective, stop at the
  same step boundary, write a checkpoint there and return ``preempted`` (the command exits 0).
- Divergence: a NaN or Inf loss or gradient norm rides in the next step's collective (train/train_step.py), and
  before every eval, checkpoint and the export the last step and the weights are checked (``settle``); either
  stops every rank with ``TrainingDiverged`` naming the step and the last finite checkpoint (the command exits
  1). No non-finite checkpoint or export is written, so an earlier export stays as it was.
- metrics.jsonl and summary.json are strict JSON: a NaN or Inf value is written as null; summary.json is written
  as one durable file (dflashkit/files.py ``atomic_write``).
- The progress bar is dflashkit/progress.py's (a line every few seconds without a terminal); its postfix shows the
  last log line's loss and speed, and tau_sim once a held-out evaluation has given one.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from dflashkit.files import atomic_write, pause_point
from dflashkit.progress import progress_bar
from dflashkit.stopping import StopRequest

from .checkpoint import save_checkpoint
from .config import TrainConfig
from .data import BlockSource, CollateOptions, block_loader, rank_slots
from .drafter_pass import extra_term_of
from .evaluate import eval_pack_tokens, evaluate
from .metrics import MetricSums, json_safe
from .run_dir import Start, check_output_paths, start_of_run
from .setup import TrainRun, setup
from .tracking import Tracker
from .train_step import StepVotes, TrainingDiverged, check_finite, train_step


def train(cfg: TrainConfig, vllm_api=None, started: float | None = None) -> dict:
    """Train as ``cfg`` says (the module docstring), holding the lock on ``cfg.output_dir`` throughout. Raises
    ``TrainingDiverged`` when a loss, gradient norm or weight becomes NaN or Inf. ``vllm_api``: the vLLM calls of
    a ``target_engine=vllm`` run (None: the installed vLLM; train/online_vllm.py). ``started``: when the run's
    clock began (metrics.jsonl's elapsed_s), for a command the process's start (``dflashkit.IMPORTED_AT``: its
    imports count); None: now."""
    from dflashkit.outputs import OutputLock

    called = time.time()
    started = called if started is None else min(float(started), called)  # setup (target load, data) included

    check_output_paths(cfg)  # before any work: the run directory, the export directory, init_from
    with OutputLock(cfg.output_dir, "train"):
        return _train(cfg, start_of_run(cfg), vllm_api, started, called)  # start: the checkpoint to resume, init_from


def _train(cfg: TrainConfig, start: Start, vllm_api=None, started: float | None = None,
           called: float | None = None) -> dict:
    # what the run holds open (an online run's capture hooks on its target), released however the run ends
    with ExitStack() as resources:
        # --- setup: data, target head, drafter, optimizer, schedule, resume (train/setup.py) -------------
        run = setup(cfg, start, resources, vllm_api)
        if started is not None:
            run.startup["setup_s"] = time.time() - started
            if called is not None and called > started:  # a command: its imports before train() was called
                run.startup["imports_s"] = called - started
        summary = _train_run(run, started)
    run.accelerator.wait_for_everyone()
    return summary


def _train_run(run: TrainRun, started: float | None = None) -> dict:
    """The loop, then the final eval and save (module docstring); the tracker and bar closed however it ends."""
    cfg = run.cfg
    tracker = Tracker(Path(cfg.output_dir), cfg.to_dict(), enabled=run.accelerator.is_main_process,
                      wandb=cfg.wandb, wandb_project=cfg.wandb_project, run_name=cfg.run_name,
                      tensorboard=cfg.tensorboard, resume_step=run.step, started=started)
    bar = training_bar(run)
    try:
        # --- the loop: one train_step per optimizer step (train/train_step.py) ---------------------------
        with StopRequest() as stop:  # SIGTERM / SIGINT: checkpoint at the next step boundary, then exit
            train_loop(run, tracker, bar, stop)
        bar.close()
        # --- eval and save: preempted, the checkpoint alone; else the final eval, checkpoint and export --
        settle(run)  # the last step's NaN/Inf flags, before its eval, checkpoint or export
        if stop.agreed:
            summary = preempted(run, stop)
        else:
            last_eval = held_out_eval(run)
            tracker.log(last_eval, run.step)
            summary = export_and_summarise(run, save_final(run), last_eval)
    finally:
        bar.close()
        tracker.close()  # metrics.jsonl keeps the rows up to a divergence
    return summary


def training_bar(run: TrainRun):
    """The run's progress bar, in optimizer steps (rank 0 only; ``progress=false``: none)."""
    return progress_bar(total=run.total_steps, initial=run.step, dynamic_ncols=True,
                        disable=not (run.accelerator.is_main_process and run.cfg.progress))


def bar_postfix(metrics: dict, last_eval: dict) -> dict:
    """What the bar shows after a log line: its loss and speed, and the last held-out tau_sim (none before the
    first evaluation)."""
    postfix = {"loss": f"{metrics['train/loss']:.3f}"}
    if "eval/tau_sim" in last_eval:
        postfix["tau_sim"] = f"{last_eval['eval/tau_sim']:.2f}"
    postfix["tok_s"] = f"{metrics['tokens_per_s']:.0f}"
    return postfix


def train_loop(run: TrainRun, tracker: Tracker, bar, stop: StopRequest) -> None:
    """Optimizer steps until the run's last step or a stop agreed by the ranks; logs, evaluates, checkpoints."""
    cfg, accelerator = run.cfg, run.accelerator
    world, G = accelerator.num_processes, cfg.grad_accum
    run.model.train()
    sums, t0 = MetricSums(run.dcfg.block_size - 1, accelerator.device, extra_term_of(run.model)), time.perf_counter()
    last_eval: dict = {}
    run.startup["from_step"] = run.step
    while run.step < run.total_steps and run.epoch < cfg.epochs and not stop.agreed:
        batches, steps_left = epoch_batches(run)
        for _ in range(steps_left):
            if run.step >= run.total_steps:
                break
            micro = [next(batches).to(accelerator.device, non_blocking=True) for _ in range(G)]
            factor = run.lr_factor()
            result = train_step(run.model, run.optimizer, accelerator, run.head, micro, cfg=cfg, lr_factor=factor,
                                sums=sums, pass_options=run.pass_options,
                                votes=StepVotes(stop.requested, run.nonfinite))
            if result.diverged:  # the previous step's, seen by every rank in this step's collective
                raise diverged(run, result.diverged)
            if result.stopped:
                stop.agreed = True
                break
            run.nonfinite = result.nonfinite
            run.step += 1
            run.done += world * G
            bar.update(1)
            # --- metrics, evaluation, checkpoints ----------------------------------------------------------
            if run.step % cfg.log_every == 0 or run.step == run.total_steps:
                metrics = train_metrics(run, sums, factor, result.grad_norm, time.perf_counter() - t0)
                tracker.log(metrics, run.step)
                if "first_log_step" not in run.startup:
                    report_startup(run, tracker.started)
                bar.set_postfix(bar_postfix(metrics, last_eval), refresh=False)  # shown at the bar's next line
                sums = MetricSums(run.dcfg.block_size - 1, accelerator.device, extra_term_of(run.model))
                t0 = time.perf_counter()
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < run.total_steps:
                settle(run)
                last_eval = held_out_eval(run)
                tracker.log(last_eval, run.step)
            if run.done >= len(run.packs[run.epoch]):
                run.epoch, run.done = run.epoch + 1, 0
            if cfg.save_every and run.step % cfg.save_every == 0:
                save(run)
            pause_point(f"step-{run.step}-done", until=lambda: stop.requested)  # test hook; returns on a stop


def report_startup(run: TrainRun, started: float) -> None:
    """Say once, at this process's first logged step, where the seconds before it went: the setup (``imports_s``:
    a command's imports before ``train`` was called; ``load_s``: the data, the target and the drafter, each also
    on its own, ``data_s``, ``target_s``, ``drafter_s``; then the optimizer and the compile wrappers), the first
    steps (in a compiled run mostly the drafter's compilation; online, the target's first passes too) and, with
    compile=true, how many graphs the compile cache had spared by then. ``started``: when elapsed_s began
    (metrics.jsonl). Kept in ``run.startup`` for summary.json; printed, so a run stopped before its end keeps it in
    its log too."""
    st = run.startup
    st["first_log_step"], st["first_log_s"] = run.step, time.time() - started
    steps, setup_s = run.step - st.get("from_step", 0), st.get("setup_s", 0.0)
    line = f"start-up: step {run.step} at {st['first_log_s']:.0f} s:"
    if "setup_s" in st:
        imports = f"imports {st['imports_s']:.0f} s; " if "imports_s" in st else ""
        each = ", ".join(f"{name} {st[f'{name}_s']:.0f} s" for name in ("data", "target", "drafter")
                         if f"{name}_s" in st)
        loads = f"loads {st.get('load_s', 0.0):.0f} s" + (f": {each}" if each else " (data, target and drafter)")
        line += f" setup {setup_s:.0f} s ({imports}{loads}), then"
    line += f" {steps} step(s) in {st['first_log_s'] - setup_s:.0f} s"
    if run.cfg.compile:
        st["compiled_graphs"] = graphs = compiled_graphs()
        line += f"; compiled graphs: {graphs['from_cache']} from the cache, {graphs['compiled']} compiled"
    run.accelerator.print(line)


def settle(run: TrainRun) -> None:
    """Raise ``TrainingDiverged`` (on every rank alike) when the last step's loss or gradient norm, or the weights,
    are NaN or Inf: called before anything is evaluated or saved."""
    what = check_finite(run.model, run.accelerator, run.nonfinite)
    if what:
        raise diverged(run, what)


def diverged(run: TrainRun, what: str) -> TrainingDiverged:
    """The one-line account of a divergence at the run's current step: what, where, the last good checkpoint."""
    last = (f"resume=auto (the default) continues from the last finite checkpoint, {run.last_saved} (step "
            f"{run.saved_step})" if run.last_saved is not None else
            "no checkpoint was written before it, so the run starts over")
    return TrainingDiverged(f"training diverged: {what} became NaN or Inf at step {run.step}; the run stopped there "
                            f"and wrote no checkpoint or export of it. Lower lr (now {run.cfg.lr:g}) or raise "
                            f"warmup_ratio and run again: {last}")


def save(run: TrainRun) -> Path:
    """The checkpoint of the run's current step, once its weights are known to be finite."""
    settle(run)
    run.last_saved = save_checkpoint(run.accelerator, run.model, run.optimizer, run.trainer_state(),
                                     Path(run.cfg.output_dir), run.cfg.keep_last)
    run.saved_step = run.step
    return run.last_saved


def preempted(run: TrainRun, stop: StopRequest) -> dict:
    """A stop agreed by the ranks: the checkpoint of the current step (the run stays unfinished)."""
    final = save_final(run)
    if run.accelerator.is_main_process:
        print(f"dflashkit train: stopped by {stop.signal_name or 'a signal on another rank'} at step {run.step} "
              f"of {run.total_steps}; checkpoint {final} written. Resume with the same command (resume=auto, "
              f"the default); `dflashkit export {final} DIR` exports it as it is.", file=sys.stderr, flush=True)
    return {"step": run.step, "planned_steps": run.planned, "preempted": True, "checkpoint": str(final),
            "startup": run.startup}


def epoch_batches(run: TrainRun):
    """This rank's micro-batches from the run's position to the end of its epoch, and the steps they make."""
    cfg, accelerator = run.cfg, run.accelerator
    slots = rank_slots(run.packs[run.epoch], run.done, accelerator.num_processes, cfg.grad_accum,
                       accelerator.process_index)
    if run.online:  # the target runs on this rank's samples in the order they are read
        run.dataset.plan([i for item, _ in slots for i in (item if isinstance(item, list) else [item])])
    source = BlockSource(run.dataset, slots, CollateOptions(
        run.dcfg.block_size, run.dcfg.mask_token_id, cfg.num_anchors, cfg.seed, run.epoch, cfg.max_length,
        use_last_hidden=run.use_last_hidden, anchor_density=cfg.anchor_density))
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
    anchors = CollateOptions(run.dcfg.block_size, run.dcfg.mask_token_id, cfg.eval_anchors, cfg.seed,
                             max_length=cfg.max_length)
    return evaluate(run.model, run.head, run.dataset, run.eval_idx, run.pass_options, anchors,
                    batch_tokens=eval_pack_tokens(cfg.micro_batch_tokens, cfg.max_length), accelerator=run.accelerator)


def save_final(run: TrainRun) -> Path:
    """The checkpoint of the run's current step: written unless it is already on disk."""
    return run.last_saved if run.saved_step == run.step else save(run)


def compiled_graphs() -> dict:
    """How this process's compiled graphs came about: ``from_cache`` (the compile cache on disk: an earlier run or
    a warm-up of the same graphs, e.g. an earlier run of the same recipe, spared their compilation) and
    ``compiled`` (compiled here, cached or not); a run whose start-up budget matters reads whether it paid."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"from_cache": int(inductor["fxgraph_cache_hit"]),
            "compiled": int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])}


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
    if cfg.compile:
        summary["compiled_graphs"] = compiled_graphs()
    summary["startup"] = dict(run.startup)  # its compiled_graphs: at the first logged step
    if accelerator.is_main_process:
        strict = json.dumps(json_safe(summary), indent=1, allow_nan=False)  # NaN and Inf as null
        atomic_write(out_dir / "summary.json", strict.encode())
        accelerator.print(json.dumps(json.loads(strict)))
    return summary
