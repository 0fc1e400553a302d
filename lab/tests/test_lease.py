"""lab/lease.py at toy size on the CPU: a plan whose stages are small Python commands, run as a lease runs them (the
order by needs, placeholders, a time limit, resume on a fresh machine from the collected archive, collect)."""

import json
import os
import signal
import sys
import tarfile

import pytest
import yaml

from lab.lease import main
from lab.lease_files import read_records, records

# each stage appends its name to order.txt, so the test reads the order the stages ran in
APPEND = "import sys; open('order.txt', 'a').write(sys.argv[1] + chr(10))"
WRITE = "import sys, pathlib; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(exist_ok=True); p.write_text(sys.argv[2])"


def toy_plan(tmp_path, **extra_stage) -> str:
    """A plan of four stages given out of their needs' order, and a fifth that sleeps past its limit."""
    stages = [
        {"name": "report", "argv": ["{python}", "-c", WRITE, "out/report.txt", "{greeting} {who}"], "limit": 60,
         "outputs": ["out/report.txt"], "needs": ["make"]},
        {"name": "make", "argv": ["{python}", "-c", APPEND, "make"], "limit": 60, "outputs": ["order.txt"],
         "needs": ["fetch"]},
        {"name": "fetch", "argv": ["{python}", "-c", WRITE, "in/data.txt", "sizes {sizes}"], "limit": 60,
         "outputs": ["in/data.txt"]},
        {"name": "echo", "argv": ["{python}", "-c", "import sys; print(sys.argv[1:])", "{sizes}"], "limit": 60},
        {"name": "slow", "argv": ["{python}", "-c", "import time; time.sleep(60)"], "limit": 1, "grace": 1,
         "optional": True, **extra_stage},
    ]
    plan = {"replaces": "nothing", "run_dir": "{run}", "vars": {"run": str(tmp_path / "run"), "greeting": "hello",
                                                                 "who": "{greeting}-world", "sizes": [1, 16]},
            "stages": stages, "collect": ["out/*.txt", "in/*.txt", "*.log"]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return str(path)


def test_stages_run_in_the_order_of_their_needs_with_placeholders_filled(tmp_path):
    plan = toy_plan(tmp_path)
    assert main(["run", plan, "--set", "who=lab", "--set", "python=" + sys.executable]) == 0
    run = tmp_path / "run"
    last = records(run)
    # the optional stage is left out unless named; the rest in the order their needs allow
    assert list(last) == ["fetch", "make", "report", "echo"]
    assert all(r["status"] == "ok" and r["rc"] == 0 for r in last.values())
    assert (run / "out" / "report.txt").read_text() == "hello lab"  # --set replaced the plan's {who}
    assert (run / "in" / "data.txt").read_text() == "sizes 1 16"  # a list inside an item: joined
    assert (run / "echo.log").read_text().strip() == "['1', '16']"  # a list as a whole item: spliced


def test_a_stage_past_its_limit_is_killed_and_recorded_as_timed_out(tmp_path):
    assert main(["run", toy_plan(tmp_path), "--stages", "slow"]) == 1
    end = records(tmp_path / "run")["slow"]
    # ended by the signal (a sleep left to end would exit 0): SIGINT at the limit, SIGKILL after the grace
    assert end["status"] == "timeout" and end["rc"] in (-signal.SIGINT, -signal.SIGKILL), end


def test_a_fresh_machine_resumes_from_the_collected_archive(tmp_path):
    plan = toy_plan(tmp_path)
    assert main(["run", plan]) == 0
    archive = tmp_path / "results.tar.gz"
    assert main(["collect", str(tmp_path / "run"), str(archive)]) == 0
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"stages.jsonl", "plan.json", "out/report.txt", "in/data.txt", "fetch.log", "report.log"} <= names
    assert "order.txt" not in names and archive.stat().st_size < 16 * 2**20

    # the fresh machine: an empty run directory holding only the archive's files. fetch and report are done (their
    # outputs are there, recorded rc 0); make's output is not there, but the stage that needs it (report) is done,
    # so it is not run again either: only echo (no outputs: always run) runs
    fresh = unpacked(archive, tmp_path / "fresh")
    assert main(["run", plan, "--set", f"run={fresh}"]) == 0
    assert started(fresh) == ["echo"] and skipped(fresh) == ["fetch", "make", "report"]

    # without report's result, report runs again and so does make (now needed); fetch's output is there: skipped
    second = unpacked(archive, tmp_path / "second")
    (second / "out" / "report.txt").unlink()
    assert main(["run", plan, "--set", f"run={second}"]) == 0
    assert started(second) == ["make", "report", "echo"] and skipped(second) == ["fetch"]
    assert (second / "order.txt").read_text() == "make\n" and (second / "out" / "report.txt").is_file()

    # without fetch's output as well, everything runs
    third = unpacked(archive, tmp_path / "third")
    (third / "out" / "report.txt").unlink()
    (third / "in" / "data.txt").unlink()
    assert main(["run", plan, "--set", f"run={third}"]) == 0
    assert started(third) == ["fetch", "make", "report", "echo"]


def unpacked(archive, folder):
    folder.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def started(run):
    """The stages the last run of ``run`` started, in order."""
    runs = [i for i, r in enumerate(read_records(run)) if r["event"] == "run"]
    return [r["stage"] for r in read_records(run)[runs[-1]:] if r["event"] == "start"]


def skipped(run):
    runs = [i for i, r in enumerate(read_records(run)) if r["event"] == "run"]
    return [r["stage"] for r in read_records(run)[runs[-1]:] if r["event"] == "skip"]


def test_a_failed_stage_blocks_the_stages_that_need_it(tmp_path):
    plan = toy_plan(tmp_path)
    raw = yaml.safe_load(open(plan))
    raw["stages"][2]["argv"] = ["{python}", "-c", "raise SystemExit(3)"]  # fetch fails
    open(plan, "w").write(yaml.safe_dump(raw))
    assert main(["run", plan]) == 1
    run = tmp_path / "run"
    assert records(run)["fetch"]["rc"] == 3 and records(run)["echo"]["rc"] == 0  # echo needs nothing: it ran
    blocked = {r["stage"]: r["reason"] for r in read_records(run) if r["event"] == "blocked"}
    assert blocked == {"make": "needs fetch", "report": "needs make"}


def test_collect_refuses_an_archive_over_its_limit(tmp_path, capsys):
    plan = toy_plan(tmp_path)
    assert main(["run", plan, "--stages", "fetch"]) == 0
    (tmp_path / "run" / "out").mkdir()
    (tmp_path / "run" / "out" / "big.txt").write_bytes(os.urandom(300_000))
    archive = tmp_path / "r.tar.gz"
    assert main(["collect", str(tmp_path / "run"), str(archive), "--max-mib", "0.1"]) == 2
    assert "out/big.txt" in capsys.readouterr().err and not archive.exists()


@pytest.mark.parametrize("bad, message", [
    ({"vars": {}}, "no variable {greeting}"),
    ({"stages_needs": "ghost"}, "needs 'ghost'"),
])
def test_a_bad_plan_is_a_one_line_error(tmp_path, capsys, bad, message):
    raw = yaml.safe_load(open(toy_plan(tmp_path)))
    if "vars" in bad:
        raw["vars"] = {"run": str(tmp_path / "run")}
    else:
        raw["stages"][0]["needs"] = [bad["stages_needs"]]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and str(path) in err


def test_status_says_one_line_per_stage(tmp_path, capsys):
    plan = toy_plan(tmp_path)
    main(["run", plan])
    capsys.readouterr()
    assert main(["status", str(tmp_path / "run")]) == 0
    runner, *lines = capsys.readouterr().out.splitlines()
    assert runner == "runner ended rc=0"
    assert [line.split()[0] for line in lines] == ["fetch", "make", "report", "echo"]
    assert all(" ok rc=0 " in line for line in lines)
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["collect"][0] == "out/*.txt"


def test_a_stage_waits_for_its_setup_step_and_the_step_runs_once(tmp_path, monkeypatch, capsys):
    raw = yaml.safe_load(open(toy_plan(tmp_path)))
    kit = tmp_path / "kit" / "env.sh"
    raw["setup"] = [{"name": "kit", "brings": [".kit"], "command": f"mkdir -p {kit.parent} && echo x >> {kit}",
                     "done": str(kit)},
                    {"name": "broken", "command": "true", "done": str(tmp_path / "never")}]
    raw["stages"][3]["setup"] = ["kit"]  # echo
    plan = tmp_path / "setup.yaml"
    plan.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr("lab.lease.SETUP_WAIT", 0)  # the kit is not coming: do not wait for it
    assert main(["run", str(plan), "--stages", "echo"]) == 1
    assert [r["reason"] for r in read_records(tmp_path / "run") if r["event"] == "blocked"] == ["setup kit not done"]

    assert main(["setup", str(plan), "kit"]) == 0 and main(["setup", str(plan), "kit"]) == 0
    assert kit.read_text() == "x\n"  # the second call found it done and ran nothing
    assert main(["setup", str(plan), "broken"]) == 1  # the command ended, its done file is not there
    assert main(["run", str(plan), "--stages", "echo"]) == 0
    assert records(tmp_path / "run")["echo"]["status"] == "ok"


def test_a_gpu_idle_stage_starts_once_no_process_computes_on_the_gpu(tmp_path, monkeypatch):
    # the CPU twin of nvidia-smi: a compute process for its first two queries, then none
    tools = tmp_path / "bin"
    tools.mkdir()
    calls = tmp_path / "calls"
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\necho q >> {calls}\n"
                                      f"[ $(wc -l < {calls}) -le 2 ] && echo 4242\nexit 0\n")
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    raw = yaml.safe_load(open(toy_plan(tmp_path)))
    raw["stages"][3]["gpu_idle"] = True  # echo
    plan = tmp_path / "gpu.yaml"
    plan.write_text(yaml.safe_dump(raw))
    assert main(["run", str(plan), "--stages", "echo"]) == 0
    assert len(calls.read_text().splitlines()) == 3  # asked until the third query found the GPU idle
    assert records(tmp_path / "run")["echo"]["status"] == "ok"
