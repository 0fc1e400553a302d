"""One runner for the lab's GPU leases, driven by a YAML plan (lab/plan_file.py says its fields; lab/plans/ holds
the plans of lab/NOTEBOOK.md's runs). How to run a lease with it: lab/README.md.

    python -m lab.lease plan lab/plans/engine026.yaml [--profile toy] [--set k=v]   # the resolved stages (dry run)
    python -m lab.lease setup lab/plans/engine026.yaml testbed-b                    # one copy-in step, unless done
    python -m lab.lease run lab/plans/engine026.yaml [--stages a,b] [--set k=v]     # in the foreground
    python -m lab.lease status RUN_DIR                                              # one line per stage
    python -m lab.lease collect RUN_DIR OUT.tar.gz                                  # the results, <= 16 MiB

A stage runs in the run directory (not the checkout, whose dflashkit/ folder would shadow an installed one) with
bench/ and lab/ importable through RUN/.packages, its output in RUN/<name>.log, under its time limit: at the limit
its process group gets SIGINT, then SIGKILL after ``grace`` seconds, and it is recorded as timed out. RUN/stages.jsonl
holds a start and an end record per stage (time, exit status, seconds). A stage whose outputs all exist and whose
last recorded exit status is 0 is skipped, and so is one that ended with 0 and every stage needing it is done (its
intermediates, like regen.jsonl or the checkpoints, need not come back): a run resumes on a fresh machine once the
collected archive is unpacked into its run directory. A stage runs only when the stages it needs succeeded or were
skipped as done.

Retiring the shell scripts: lab/testbed_*.sh, lab/run_lib.sh stay while their CPU twins are tested in lab/tests/.
Each plan names the script it replaces; once a plan's toy profile is tested here (test_lease_plans.py) and a GPU
lease has run from it, its script and that script's test go, and run_lib.sh goes with the last of them.
lab/vllm_env.sh and lab/import_path.sh stay: the plans call them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflashkit.errors import UserError
from lab.lease_files import collect, records, stage_lines
from lab.plan_file import ROOT, Plan, Stage, load_plan, parse_sets

GPU_IDLE_WAIT = 120  # seconds a gpu_idle stage waits for the GPU's compute processes to end
SETUP_WAIT = 900  # seconds a stage waits for the setup steps it names (a kit installed by a later copy-in command)


def note(run_dir: Path, **record) -> None:
    """One JSON line appended to RUN/stages.jsonl."""
    with open(run_dir / "stages.jsonl", "a") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def is_done(stage: Stage, run_dir: Path, last: dict) -> bool:
    """Whether ``stage`` may be skipped: it has outputs, they all exist, and its last end record says rc 0."""
    end = last.get(stage.name)
    return (bool(stage.outputs) and all((run_dir / o).exists() for o in stage.outputs)
            and end is not None and end.get("rc") == 0)


def done_stages(plan: Plan, last: dict) -> set[str]:
    """The stages that need not run: those done by ``is_done``, and those whose recorded exit status was 0 and every
    stage needing them is done (a fresh machine gets the results back, not the intermediates: regen.jsonl and the
    training checkpoints need not come back once training and the export are done)."""
    done = {s.name for s in plan.stages if is_done(s, plan.run_dir, last)}
    for stage in reversed(plan.stages):  # a stage's dependents come after it
        users = [s.name for s in plan.stages if stage.name in s.needs]
        if users and all(u in done for u in users) and last.get(stage.name, {}).get("rc") == 0:
            done.add(stage.name)
    return done


def wait_gpu_idle(run_dir: Path) -> None:
    """Until no compute process is on the GPU (at most GPU_IDLE_WAIT s): vLLM's start-up profiling must run alone.
    Without nvidia-smi (the CPU) there is nothing to wait for."""
    for _ in range(GPU_IDLE_WAIT):
        try:
            query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return
        if query.returncode != 0 or not query.stdout.strip():  # no driver to ask, or no process on the GPU
            return
        time.sleep(1)
    note(run_dir, event="note", text=f"the GPU is still busy after {GPU_IDLE_WAIT} s")


def setup_ready(plan: Plan, stage: Stage) -> str | None:
    """None when every setup step ``stage`` names is done (waiting up to SETUP_WAIT s), else the first missing."""
    if plan.skip_setup:
        return None
    steps = {s.name: s for s in plan.setup}
    deadline = time.monotonic() + SETUP_WAIT
    for name in stage.setup:
        while not Path(steps[name].done).exists():
            if time.monotonic() > deadline:
                return name
            time.sleep(3)
    return None


def stage_env(plan: Plan, stage: Stage) -> dict[str, str]:
    """This environment, the plan's and the stage's variables, and RUN/.packages (links to bench/, lab/ and tests/,
    whose support/ holds the CPU twins of vLLM the toy profiles serve with) on PYTHONPATH so that `python -m lab.X`
    works from the run directory."""
    packages = plan.run_dir / ".packages"
    packages.mkdir(exist_ok=True)
    for name in ("bench", "lab", "tests"):
        link = packages / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **plan.env, **stage.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(packages)) if p)
    return env


def run_stage(plan: Plan, stage: Stage) -> tuple[int, str]:
    """Run one stage under its limit; returns (exit status, "ok" | "failed" | "timeout")."""
    run_dir = plan.run_dir
    for output in stage.outputs:  # the folders a stage writes into exist (the shell scripts made $RUN/<stage>/)
        (run_dir / output).parent.mkdir(parents=True, exist_ok=True)
    note(run_dir, event="start", stage=stage.name, argv=stage.argv, limit=stage.limit)
    start = time.monotonic()
    with open(run_dir / f"{stage.name}.log", "w") as log:
        try:
            proc = subprocess.Popen(stage.argv, cwd=run_dir, env=stage_env(plan, stage), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:  # no such program: a failed stage, not a crashed runner
            log.write(f"cannot start {stage.argv[0]}: {e}\n")
            note(run_dir, event="end", stage=stage.name, rc=127, status="failed", seconds=0.0)
            return 127, "failed"
        status = None
        try:
            rc = proc.wait(timeout=stage.limit)
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGINT)  # the whole group: vLLM's engine core is a child process
            try:
                rc = proc.wait(timeout=stage.grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        _kill_leftovers(proc.pid)
    status = status or ("ok" if rc == 0 else "failed")
    note(run_dir, event="end", stage=stage.name, rc=rc, status=status, seconds=round(time.monotonic() - start, 1))
    return rc, status


def _kill_leftovers(group: int) -> None:
    """Children of a finished stage still in its process group (an engine core left behind) are killed, so the
    next engine starts alone."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_plan(plan: Plan, only: list[str] | None) -> int:
    """The plan's stages (``only`` those named, in plan order; else all but the optional ones); 0 when every stage
    run or skipped succeeded, 1 when one failed, timed out or was blocked."""
    names = [s.name for s in plan.stages]
    for name in only or []:
        if name not in names:
            raise UserError(f"--stages: {name!r} is not a stage of {plan.path} ({', '.join(names)})")
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    (plan.run_dir / "plan.json").write_text(json.dumps({"plan": str(plan.path), "collect": plan.collect,
                                                        "stages": [s.name for s in plan.stages]}, indent=1))
    note(plan.run_dir, event="run", plan=str(plan.path), stages=only or names, pid=os.getpid())
    last = records(plan.run_dir)
    good = done_stages(plan, last)
    worst = 0
    for stage in plan.stages:
        if (only and stage.name not in only) or (not only and stage.optional):
            continue
        if stage.name in good:
            reason = ("outputs present, recorded rc 0" if is_done(stage, plan.run_dir, last)
                      else "recorded rc 0, every stage that needs it done")
            note(plan.run_dir, event="skip", stage=stage.name, reason=reason)
            continue
        missing = [n for n in stage.needs if n not in good]
        waiting = None if missing else setup_ready(plan, stage)
        if missing or waiting:
            why = f"needs {', '.join(missing)}" if missing else f"setup {waiting} not done"
            note(plan.run_dir, event="blocked", stage=stage.name, reason=why)
            worst = worst or 1
            continue
        if stage.gpu_idle:
            wait_gpu_idle(plan.run_dir)
        rc, _ = run_stage(plan, stage)
        if rc == 0:
            good.add(stage.name)
        else:
            worst = 1
    note(plan.run_dir, event="done", rc=worst)
    return worst


def run_setup(plan: Plan, name: str) -> int:
    """One setup step's command (in the checkout, by bash), unless its done-check already holds."""
    step = next((s for s in plan.setup if s.name == name), None)
    if step is None:
        raise UserError(f"{plan.path}: no setup step {name!r} ({', '.join(s.name for s in plan.setup)})")
    if Path(step.done).exists():
        print(f"{name}: already done ({step.done})")
        return 0
    rc = subprocess.run(["bash", "-c", step.command], cwd=ROOT).returncode
    if rc == 0 and not Path(step.done).exists():
        print(f"{name}: the command ended but {step.done} is not there", file=sys.stderr)
        return 1
    return rc


def print_plan(plan: Plan) -> None:
    """The resolved plan: setup steps, then each stage with its limit, needs, outputs and argv."""
    print(f"plan {plan.path} (replaces {plan.replaces or 'nothing'}); run dir {plan.run_dir}")
    for step in plan.setup:
        print(f"setup {step.name}: brings {' '.join(step.brings) or '-'}; done when {step.done}\n  {step.command}")
    for s in plan.stages:
        flags = (" gpu_idle" if s.gpu_idle else "") + (" optional" if s.optional else "")
        print(f"stage {s.name}: limit {s.limit:g} s, needs {','.join(s.needs) or '-'}, "
              f"outputs {' '.join(s.outputs) or '-'}{flags}\n  {' '.join(s.argv)}")
    print(f"collect {' '.join(plan.collect)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.lease", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "plan", "setup"):
        c = sub.add_parser(name)
        c.add_argument("plan")
        if name == "setup":
            c.add_argument("step")
        c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        c.add_argument("--profile", default=None, help="a profile of the plan (toy: the CPU twin)")
        if name == "run":
            c.add_argument("--stages", default=None, help="comma-separated: only these stages")
    c = sub.add_parser("status")
    c.add_argument("run_dir")
    c = sub.add_parser("collect")
    c.add_argument("run_dir")
    c.add_argument("out")
    c.add_argument("--max-mib", type=float, default=16.0)
    args = p.parse_args(argv)
    try:
        if args.command == "status":
            print("\n".join(stage_lines(Path(args.run_dir))))
            return 0
        if args.command == "collect":
            print(collect(Path(args.run_dir), Path(args.out), args.max_mib))
            return 0
        plan = load_plan(args.plan, parse_sets(args.set), args.profile)
        if args.command == "plan":
            print_plan(plan)
            return 0
        if args.command == "setup":
            return run_setup(plan, args.step)
        return run_plan(plan, args.stages.split(",") if args.stages else None)
    except UserError as e:
        print(f"lab.lease {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
