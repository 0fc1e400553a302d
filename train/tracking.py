"""Where training metrics go: a JSON-lines file always, Weights & Biases and TensorBoard when asked.

Design choices:
- Only the main process logs. ``metrics.jsonl`` in the output dir is the record every other view is built from
  (tests compare loss trajectories with it; reported results are read from it). It is strict JSON: a NaN or Inf
  metric (nothing to count, or the step a run diverged at) is written as null. It is an append log
  (dflashkit/files.py): each row is on the disk when ``log`` returns; a crash leaves at most one cut last row,
  which the reader skips and a resumed run cuts off before it appends. Every row carries ``wall_time`` (Unix
  seconds) and ``elapsed_s`` (seconds since this process's run began, its setup included, and for `dflashkit
  train` the process's imports; a resumed run starts again from 0), so the wall time to a quality can be read
  off.
- The rows never run ahead of the run's durable state for long: a run that resumes from the checkpoint of step S
  (or starts again at 0, no checkpoint having been written) first drops the rows of steps after S, which the
  earlier process logged but never saved (it was killed, or its save failed), so the file holds each step once,
  and only steps that led to the resumed state. Rows are still written as steps run (a live run's curves stay
  live); between two checkpoints they are of steps a crash would take back, and the next resume takes them out.
- wandb and tensorboard are imported lazily; wandb runs in offline mode when no ``WANDB_API_KEY`` is set (the
  run can be synced later with ``wandb sync``). A missing wandb package is a warning, not an error (a run of
  days should not die for a dashboard; metrics.jsonl has everything); a missing tensorboard is an error.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflashkit.files import atomic_write, open_appending, sync, whole_lines

from .metrics import json_safe


class Tracker:
    def __init__(self, output_dir: str | os.PathLike, config: dict, *, enabled: bool, wandb: bool,
                 wandb_project: str, run_name: str, tensorboard: bool, resume_step: int = 0,
                 started: float | None = None):
        self.enabled = enabled
        self.started = time.time() if started is None else float(started)
        self.wandb_run = None
        self.tb = None
        if not enabled:
            return
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        kept = whole_lines(self.dir / "metrics.jsonl")  # a row cut by a crash is cut off before this run appends
        drop_rows_after(self.dir / "metrics.jsonl", kept, resume_step)
        self.file = open_appending(self.dir / "metrics.jsonl")
        name = run_name or self.dir.resolve().name
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                wb = None
                print("warning: wandb is not installed; metrics go to metrics.jsonl only "
                      "(`pip install wandb`, or set wandb=false to silence this)")
        if wandb and wb is not None:
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wb.init(project=wandb_project, name=name, config=config, dir=str(self.dir),
                                     mode=mode, id=self._wandb_id(name), resume="allow")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError("tensorboard is not installed: `pip install tensorboard` or set "
                                   "tensorboard=false") from None
            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_step or None)

    def _wandb_id(self, name: str) -> str:
        """One W&B run per output dir, so a resumed run continues the same curves."""
        f = self.dir / "wandb-run-id"
        if f.is_file():
            return f.read_text().strip()
        import uuid

        run_id = f"{name[:40]}-{uuid.uuid4().hex[:8]}".replace("/", "-")
        atomic_write(f, run_id.encode())
        return run_id

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        row = {"step": int(step), **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()},
               "wall_time": now, "elapsed_s": now - self.started}
        self.file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
        sync(self.file)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=int(step))
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tb is not None:
            self.tb.close()


def drop_rows_after(path: Path, text: bytes, step: int) -> None:
    """Rewrite the log ``path`` (its whole lines ``text``) without the rows of steps after ``step``, if it has any:
    they were logged by a process whose state at those steps was never saved (the module docstring)."""
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        atomic_write(path, b"".join(kept))


def read_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """The rows of metrics.jsonl; after a resume the latest row of each (step, kind) wins. A cut last row (a crash
    while it was written) is skipped."""
    path = Path(output_dir) / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    rows = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    latest: dict = {}
    for r in rows:
        latest[(r["step"], tuple(sorted(r)))] = r
    return sorted(latest.values(), key=lambda r: r["step"])
