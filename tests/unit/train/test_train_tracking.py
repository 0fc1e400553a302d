"""metrics.jsonl is an append log (dflashkit/files.py): each row synced when ``log`` returns, a row cut by a crash
skipped by the reader and cut off before a resumed run appends."""

from dflashkit.train.tracking import Tracker, read_metrics

from support.fsyncs import record_fsyncs


def tracker(out):
    return Tracker(out, {}, enabled=True, wandb=False, wandb_project="", run_name="", tensorboard=False)


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
    resumed = tracker(out)
    resumed.log({"train/loss": 2.0}, step=2)
    resumed.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(out)] == [(1, 2.5), (2, 2.0)]
