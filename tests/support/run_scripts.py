"""Running the one-GPU lab scripts (lab/testbed_*_run.sh) at their CPU scale, as the lab's tests (lab/tests/) do."""

import os
import subprocess
import sys
from pathlib import Path

from support.chat_data import chat_records, write_jsonl

ROOT = Path(__file__).parents[2]


def toy_data(folder: Path, **counts: int) -> Path:
    """``folder``/NAME.jsonl of ``count`` chat conversations for each NAME=count (sharegpt=10, mtbench=3, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    for seed, (name, count) in enumerate(counts.items(), start=1):
        write_jsonl(folder / f"{name}.jsonl", chat_records(count, seed=seed))
    return folder


def run_toy_script(script: str, run: Path, limits: tuple = (), **env: str) -> dict[str, str]:
    """Run ``lab/<script>`` from the checkout's root with SCALE=toy, RUN=``run`` and ``env``, with this Python's
    folder first on PATH, every process on one thread (the stages run side by side on a CPU that other test
    workers share: more threads only contend, many times slower) and every stage time limit named in ``limits``
    set to an hour (far beyond any toy stage: no test depends on timing). Checks that it exits 0, ends with "all
    done" and that every stage it ran exited 0 (the stage's log in the message otherwise); returns stage name ->
    its 'NAME: rc=0 S s' line."""
    full_env = {**os.environ, "SCALE": "toy", "RUN": str(run), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                **{name: "3600" for name in limits}, **env}
    proc = subprocess.run(["bash", f"lab/{script}"], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=5400)
    stages = (run / "stages.txt").read_text() if (run / "stages.txt").is_file() else "(no stages.txt)"
    assert proc.returncode == 0, proc.stderr[-2000:] + stages
    assert stages.rstrip().endswith("all done"), stages
    ends = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in stages.splitlines() if ": rc=" in line}
    for name, line in ends.items():
        assert " rc=0 " in line, f"{name}: {line}\n{(run / f'{name}.log').read_text()[-3000:]}"
    return ends
