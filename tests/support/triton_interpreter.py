"""Scripts run as ``python -c SCRIPT IMPORT_PATH ...`` with TRITON_INTERPRET=1: Triton kernels on the CPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dflashkit

# The start of such a script: it makes the interpreter work with numpy >= 2.4 and puts IMPORT_PATH on sys.path:
# the tests folder (so ``support``) and the folder that holds the dflashkit the tests imported. Not the repository
# root: its dflashkit/ holds only the top package (pyproject.toml maps train/, eval/, ... into it), so where
# dflashkit is not installed (a lab/import_path.sh folder on PYTHONPATH) the root would hide dflashkit.train.
INTERPRETER_PREAMBLE = textwrap.dedent("""
    import json, os, sys, torch
    import numpy
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        # the interpreter turns 1-element arrays into loop bounds with int(), which numpy >= 2.4 refuses
        import triton.runtime.interpreter as interp
        original = interp._patch_lang_tensor
        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = patched
    sys.path[:0] = sys.argv[1].split(os.pathsep)
""")


def count_launches(module: str) -> str:
    """Script lines (after INTERPRETER_PREAMBLE) that count the calls of ``module``'s ``launch_forward`` and
    ``launch_backward`` in a dict ``launches`` ({"forward": n, "backward": n}), which the script then prints."""
    return textwrap.dedent(f"""
        import {module} as kernel
        launches = {{"forward": 0, "backward": 0}}
        forward, backward = kernel.launch_forward, kernel.launch_backward
        def counted_forward(*args, **kwargs):
            launches["forward"] += 1
            return forward(*args, **kwargs)
        def counted_backward(*args, **kwargs):
            launches["backward"] += 1
            return backward(*args, **kwargs)
        kernel.launch_forward, kernel.launch_backward = counted_forward, counted_backward
    """)


def run_in_interpreter(script: str, *args: str):
    """Run ``script`` (INTERPRETER_PREAMBLE + the test's own lines) under TRITON_INTERPRET=1 in a fresh process
    and return the JSON its last line prints; skip where Triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests_dir = Path(__file__).resolve().parents[1]
    package_root = Path(dflashkit.__file__).parents[1]  # not resolved: import_path.sh's files are links
    import_path = os.pathsep.join([str(tests_dir), str(package_root)])
    run = subprocess.run([sys.executable, "-c", script, import_path, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
