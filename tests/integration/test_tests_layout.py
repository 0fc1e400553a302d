"""The layout of tests/ (issue 23), held by reading every file under it with ``ast`` (nothing is imported):

- every test module (``test_*.py``) lives in ``tests/unit/<room>/`` (one of ROOMS, the project's top-level
  folders) when it tests one room's pieces, or in ``tests/integration/`` when it runs several rooms together;
- no file under tests/ imports a test module or a ``conftest.py``: what tests share is in ``tests/support/`` (a
  package of helpers, imported as ``support.<module>``) or is a fixture of a conftest.py, which pytest supplies;
- tests/support/ holds no test module.
A self-test feeds the checker small synthetic trees that break each rule and checks it names the break.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

ROOMS = ("drafter", "targets", "extract", "train", "eval", "dflashkit")  # tests/unit/<room>/: the top-level folders


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
             "unit/eval/test_a.py": "from support.chat import x\nimport dflashkit.eval.engine",
             "unit/eval/conftest.py": "from support.chat import x", "integration/test_b.py": "import json"}
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
    }
    for what, (expected, tree) in breaks.items():
        found = layout_problems(tree)
        assert any(expected in line for line in found), f"{what}: not caught ({found})"
