"""metrics.jsonl is an append log (dflashkit/files.py): each row synced when ``log`` returns, a row cut by a crash
skipped by the reader and cut off before a resumed run appends."""

import json

from dflashkit.train.tracking import Tracker, read_metrics

from support.fsyncs import record_fsyncs


def tracker(out, resume_step=0):
    return Tracker(out, {}, enabled=True, wandb=False, wandb_project="", run_name="", tensorboard=False,
                   resume_step=resume_step)


def test_each_metrics_row_is_synced_and_a_cut_row_is_dropped_on_resume(tmp_path, monkeypatch):
    out = tmp_path / "run"
    log = record_fsyncs(monkeypatch)
    first = tracker(out)
    assert log.paths == [out.resolve()]  # the log's name made durable before a row is written
    first.log({"train/loss": 2.5}, step=1)
    assert log.paths[-1] == (out / "metrics.jsonl").resolve()  # the row synced
    first.close()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "train/lo')  # a crash while the next row was written
    assert [r["step"] for r in read_metrics(out)] == [1]
    resumed = tracker(out, resume_step=1)
    resumed.log({"train/loss": 2.0}, step=2)
    resumed.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(out)] == [(1, 2.5), (2, 2.0)]


def test_a_resume_drops_the_rows_of_steps_never_saved(tmp_path):
    """A run logged steps 1-4, then its save of step 4 failed (or it was killed): its newest checkpoint is step 2.
    The rows of steps 3 and 4 described a state that no longer exists; they used to stay, beside the resumed
    run's own rows for the same steps."""
    out = tmp_path / "run"
    first = tracker(out)
    for step in range(1, 5):
        first.log({"train/loss": 5.0 - step}, step=step)
    first.log({"eval/tau_sim": 1.5}, step=2)
    first.close()
    resumed = tracker(out, resume_step=2)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2]
    resumed.log({"train/loss": 0.5}, step=3)
    resumed.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("train/loss")) for r in rows] == [(1, 4.0), (2, 3.0), (2, None), (3, 0.5)]
    restarted = tracker(out)  # killed before its first checkpoint: the run starts again at step 0
    restarted.close()
    assert (out / "metrics.jsonl").read_text() == ""
