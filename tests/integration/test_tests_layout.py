"""The layout of tests/ (issue 23), held by reading every file under it with ``ast`` (nothing is imported):

- every test module (``test_*.py``) lives in ``tests/unit/<room>/`` (one of ROOMS, the project's top-level
  folders) when it tests one room's pieces, or in ``tests/integration/`` when it runs several rooms together;
- no file under tests/ imports a test module or a ``conftest.py``: what tests share is in ``tests/support/`` (a
  package of helpers, imported as ``support.<module>``) or is a fixture of a conftest.py, which pytest supplies;
- tests/support/ holds no test module;
- no module under ``tests/unit/`` starts a process (imports subprocess, multiprocessing or the process helpers of
  tests/support/, reads ``sys.executable``, calls ``os.fork`` / ``os.system`` / an exec or spawn): a test that runs
  a command in a fresh process, a launcher or several ranks is an integration test, so that tests/unit/ stays fast
  and runs in process.
A self-test feeds the checker small synthetic trees that break each rule and checks it names the break.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.paths import ROOT

ROOMS = ("drafter", "targets", "extract", "train", "eval", "dflashkit")  # tests/unit/<room>/: the top-level folders
# a name that starts a process: the modules that do it (subprocess, multiprocessing, the helpers of support/ that
# run commands), the interpreter's path (to run `python -m ...`), os's fork / system / popen / exec* / spawn*
STARTS_A_PROCESS = re.compile(
    r"subprocess|multiprocessing|torch\.multiprocessing|support\.processes|support\.run_scripts"
    r"|sys\.executable|os\.(fork|forkpty|system|popen|posix_spawnp?|spawn\w*|exec\w+)"
    r"|concurrent\.futures\.(process|ProcessPoolExecutor)|asyncio\.create_subprocess_\w+|pty\.spawn")


def imported_modules(source: str) -> list[tuple[str, int]]:
    """(module, line) for every import of ``source``, lazy ones included; ``from M import x`` counts as M and M.x
    (x may be a module); a relative import as its dots followed by the module name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            out.append((module, node.lineno))
            out += [(f"{module.rstrip('.')}.{a.name}" if node.module else module + a.name, node.lineno)
                    for a in node.names]
    return out


def is_test_module(module: str) -> bool:
    """Whether an imported name is a test module or a conftest (``test_x``, ``tests.test_x``, ``conftest``,
    ``tests.conftest``, ``.test_x``, ...)."""
    last = module.lstrip(".").split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def dotted_name(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` for an attribute chain on a name, its head resolved through the module's import ``aliases``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def starting_part(name: str) -> str | None:
    """The shortest leading part of a dotted name that starts a process (``subprocess`` of ``subprocess.run``,
    ``sys.executable`` of ``sys.executable.strip``), or None."""
    parts = name.split(".")
    return next((head for head in (".".join(parts[:k]) for k in range(1, len(parts) + 1))
                 if STARTS_A_PROCESS.fullmatch(head)), None)


def process_starts(source: str) -> list[tuple[str, int]]:
    """(name, line) for each import or use in ``source`` of a name that starts a process (STARTS_A_PROCESS); an
    alias (``import sys as s``, ``from os import system as run``) is read as the name it stands for."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    uses = [(dotted_name(node, aliases), node.lineno) for node in ast.walk(tree)
            if isinstance(node, (ast.Attribute, ast.Name)) and id(node) not in inner]
    found = {(starting_part(name), line) for name, line in imported_modules(source) + uses if name}
    return sorted((name, line) for name, line in found if name)


def layout_problems(files: dict[str, str]) -> list[str]:
    """Every break of the layout in ``files`` (path relative to tests/ -> source), one line each."""
    found = []
    for path, source in sorted(files.items()):
        parts = Path(path).parts
        name = parts[-1]
        if name.startswith("test_") and name.endswith(".py"):
            in_unit_room = len(parts) == 3 and parts[0] == "unit" and parts[1] in ROOMS
            in_integration = len(parts) == 2 and parts[0] == "integration"
            if parts[0] == "support":
                found.append(f"tests/{path}: a test module inside support/ (support holds helpers only)")
            elif not (in_unit_room or in_integration):
                found.append(f"tests/{path}: a test module belongs in tests/unit/<room>/ (rooms: {', '.join(ROOMS)}) "
                             "or tests/integration/")
        for module, line in imported_modules(source):
            if is_test_module(module):
                found.append(f"tests/{path} (line {line}) imports {module}: move what it shares to tests/support/ "
                             "(or, for a fixture, to a conftest.py)")
        if parts[0] == "unit":
            found += [f"tests/{path} (line {line}): {name} starts a process; a test that runs a command in a fresh "
                      "process, a launcher or several ranks belongs in tests/integration/"
                      for name, line in process_starts(source)]
    return found


def files_under_tests() -> dict[str, str]:
    """Every .py file under tests/: path relative to tests/ -> source."""
    tests = ROOT / "tests"
    return {str(p.relative_to(tests)): p.read_text() for p in sorted(tests.rglob("*.py"))
            if "__pycache__" not in p.parts}


# ---------------------------------------------------------------- the tests


def test_the_tests_keep_the_layout():
    files = files_under_tests()
    assert {"conftest.py", "support/__init__.py", "integration/test_tests_layout.py"} <= set(files)
    assert any(Path(p).parts[:2] == ("unit", "train") for p in files)
    for room in ROOMS:
        assert (ROOT / room).is_dir(), f"room {room}: no such top-level folder"
    found = layout_problems(files)
    assert not found, "\n".join(found)


def test_the_checker_catches_each_kind_of_break():
    clean = {"conftest.py": "import pytest\nfrom support.paths import ROOT",
             "support/paths.py": "from pathlib import Path", "support/chat.py": "from .paths import ROOT",
             "unit/eval/test_a.py": "from support.chat import x\nimport dflashkit.eval.decoder",
             "unit/eval/conftest.py": "from support.chat import x", "integration/test_b.py": "import json",
             # in process: the path helpers of os and sys; in integration: any process
             "unit/eval/test_c.py": "import os, sys\nsys.path.insert(0, os.path.join('a'))\nos.environ.get('X')",
             "integration/test_d.py": "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'dflashkit'])"}
    assert layout_problems(clean) == []
    breaks = {
        "a test module at the top": ("tests/test_a.py: a test module belongs in", {"test_a.py": ""}),
        "a room that is none": ("tests/unit/misc/test_a.py: a test module belongs in", {"unit/misc/test_a.py": ""}),
        "a test module under a room's subfolder": ("belongs in", {"unit/eval/deep/test_a.py": ""}),
        "a test module in support": ("inside support/", {"support/test_helpers.py": ""}),
        "imports conftest": ("imports conftest", {"unit/eval/test_a.py": "from conftest import VOCAB"}),
        "imports tests.conftest": ("imports tests.conftest",
                                   {"unit/eval/test_a.py": "from tests.conftest import VOCAB"}),
        "imports a test module": ("imports test_b", {"unit/eval/test_a.py": "import test_b"}),
        "imports a test module lazily": ("(line 2) imports test_b",
                                         {"unit/eval/test_a.py": "def f():\n    from test_b import fixture"}),
        "imports a test module as a package member": ("imports tests.unit.eval.test_b",
                                                      {"unit/eval/test_a.py": "from tests.unit.eval import test_b"}),
        "relative import of a test module": ("imports .test_b", {"unit/eval/test_a.py": "from . import test_b"}),
        "support imports a test module": ("tests/support/chat.py (line 1) imports test_b",
                                          {"support/chat.py": "from test_b import x"}),
        # a unit test that starts a process
        "imports subprocess": ("tests/unit/eval/test_a.py (line 1): subprocess starts a process",
                               {"unit/eval/test_a.py": "import subprocess"}),
        "imports from subprocess": ("(line 1): subprocess starts",
                                    {"unit/eval/test_a.py": "from subprocess import run"}),
        "imports subprocess lazily, aliased": ("(line 2): subprocess starts",
                                               {"unit/eval/test_a.py": "def f():\n    import subprocess as sp"}),
        "runs sys.executable": ("(line 2): sys.executable starts",
                                {"unit/eval/test_a.py": "import sys\nCMD = [sys.executable, '-m', 'dflashkit']"}),
        "sys.executable imported by name": ("(line 1): sys.executable starts",
                                           {"unit/eval/test_a.py": "from sys import executable as python"}),
        "sys.executable through an alias of sys": ("(line 2): sys.executable starts",
                                                   {"unit/eval/test_a.py": "import sys as s\nx = s.executable"}),
        "multiprocessing spawn": ("(line 2): multiprocessing starts", {
            "unit/train/test_a.py": "def f():\n    import multiprocessing\n    multiprocessing.get_context('spawn')"}),
        "torch's spawn": ("(line 1): torch.multiprocessing starts",
                          {"unit/train/test_a.py": "import torch.multiprocessing as mp\nmp.spawn(f, nprocs=2)"}),
        "torch's spawn without an import of it": ("(line 2): torch.multiprocessing starts", {
            "unit/train/test_a.py": "import torch\ntorch.multiprocessing.spawn(f)"}),
        "os.fork": ("(line 2): os.fork starts", {"unit/train/test_a.py": "import os\npid = os.fork()"}),
        "os.system": ("(line 2): os.system starts", {"unit/train/test_a.py": "import os\nos.system('ls')"}),
        "an exec of os": ("(line 1): os.execv starts", {"unit/train/test_a.py": "from os import execv"}),
        "the helpers that run commands": ("(line 1): support.processes starts",
                                          {"unit/train/test_a.py": "from support.processes import run_checked"}),
        "the bench script runner": ("(line 1): support.run_scripts starts",
                                    {"unit/train/test_a.py": "from support import run_scripts"}),
        "a unit room's conftest": ("tests/unit/train/conftest.py (line 1): subprocess starts",
                                   {"unit/train/conftest.py": "import subprocess"}),
    }
    for what, (expected, tree) in breaks.items():
        found = layout_problems(tree)
        assert any(expected in line for line in found), f"{what}: not caught ({found})"
