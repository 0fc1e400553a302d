"""The import DAG of docs/ARCHITECTURE.md, held by reading every module's imports with ``ast`` (nothing is imported).

Every ``.py`` file of the mapped folders (pyproject.toml ``[tool.setuptools.package-dir]``), of ``bench/`` and of
``lab/`` is parsed; every ``import`` / ``from ... import`` in it counts, at module level or inside a function (a lazy
import is still a dependency). Seven rules:
- rooms: a module imports, besides its own room, only what its room's row of ``MAY_IMPORT`` lists;
- the lab: no module outside ``lab/`` imports one of it (``*`` in a row means any module but the lab's);
- test doubles: no module of the product or bench/ imports the tests' support package (``tests.support`` or
  ``support``: the CPU twins of vLLM, fixtures); a double reaches the product through its ``api`` parameters, and
  only the lab (from the checkout's root, as ``tests.support``) may import one;
- no path edits: no module touches ``sys.path`` nor imports a module of bench/ or lab/ by its bare name (a script
  reaches shared code as ``bench.common`` or ``lab.x``, so every import is one this test can see);
- commands: no module imports a command module (``__main__``); ``dflashkit.cli`` reaches them by name;
- private names: no module imports another module's ``_name`` (nor a module whose name starts with ``_``);
- cycles: the graph of module imports has no cycle.
A self-test feeds the checker small synthetic trees that break each rule and checks it names the break.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.paths import ROOT

# The rooms, a name prefix each (under `dflashkit.`): a module is in the room of its longest prefix of its name.
# Row: what a room's modules may import besides their own room ("*": any module of the project).
MAY_IMPORT = {
    "helpers": ("helpers",),  # the top-level helpers (HELPERS): import only each other
    "drafter.modeling_dflash": (),  # modeling_dflash*.py ship inside exports: they run without dflashkit
    "drafter": ("helpers", "drafter.modeling_dflash"),
    "targets": ("helpers", "drafter"),
    "extract.data": ("helpers", "drafter", "targets"),  # chat data: records, rendering, batching
    "extract.shards": ("helpers", "drafter", "targets"),  # shard format, manifest, reader, writer, verify
    "extract.generation": ("helpers", "drafter", "targets", "extract.data"),  # answerers, slot generator
    "extract": ("helpers", "drafter", "targets", "extract.data", "extract.shards", "extract.generation"),  # run
    "train": ("helpers", "drafter", "targets", "extract.data", "extract.shards"),
    # eval reads records and renders prompts as training does (the one renderer); no train, no other extract module
    "eval": ("helpers", "drafter", "targets", "extract.data.sources", "extract.data.rendering"),
    "commands": ("*",),  # the `dflashkit` command's own subcommands (demo, __main__)
    "bench": ("*",),  # the benchmarks a user runs on their own drafter
    "lab": ("*",),  # studies, lease plans and their tests: may import the product and bench, never imported back
}
# every room imports these:
HELPERS = ("dflashkit", "dflashkit.errors", "dflashkit.untrusted", "dflashkit.outputs", "dflashkit.files",
           "dflashkit.options", "dflashkit.launch", "dflashkit.stopping", "dflashkit.progress", "dflashkit.cli")
COMMANDS = ("dflashkit.demo", "dflashkit.__main__")  # top-level modules of the "commands" room
TESTS_SUPPORT = ("tests", "support")  # tests/support/ as the lab (tests.support) and pytest (support) import it


# ---------------------------------------------------------------- reading the tree


def package_folders(root: Path = ROOT) -> dict[str, str]:
    """import name -> folder, from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    section = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]")[1].split("\n[")[0]
    folders = dict(re.findall(r'^"([\w.]+)" = "([\w./]+)"', section, flags=re.M))
    assert "dflashkit.extract" in folders, "pyproject.toml: no [tool.setuptools.package-dir] mapping found"
    return folders


def project_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is_package) for every module of the project (bench/ as ``bench.*``, lab/ as
    ``lab.*``)."""
    folders = {**package_folders(root), "bench": "bench", "lab": "lab"}
    modules = {}
    for package, folder in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            modules[name] = (path.read_text(), is_package)
    return modules


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each import of ``source``. ``from M import x`` where
    ``M.x`` is a module in ``known`` counts as an import of that module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (module, a.name, node.lineno))
    return out


def room_of(module: str) -> str | None:
    """The room of a project module (None: not the project's)."""
    if module in HELPERS:
        return "helpers"
    if module in COMMANDS:
        return "commands"
    for folder in ("bench", "lab"):
        if module == folder or module.startswith(folder + "."):
            return folder
    if not module.startswith("dflashkit."):
        return None
    rest = module.removeprefix("dflashkit.")
    rooms = [r for r in MAY_IMPORT if rest == r or rest.startswith(r)]
    return max(rooms, key=len) if rooms else None


def _matches(module: str, entry: str) -> bool:
    """Whether ``module`` is in the room ``entry`` (or is the module ``entry``, or inside that package)."""
    full = f"dflashkit.{entry}"
    return room_of(module) == entry or module == full or module.startswith(full + ".")


def path_uses(name: str, source: str) -> list[str]:
    """One line for each use of ``sys.path`` in ``source`` (``import sys as s`` is read as sys too)."""
    tree = ast.parse(source)
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name == "sys"}
    return [f"{name} (line {n.lineno}) uses sys.path: import the shared module by its package name instead "
            "(bench.common, lab.x)" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
            and n.value.id in names]


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


# ---------------------------------------------------------------- the rules


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """Every break of the four rules in ``modules`` (name -> (source, is_package)), one line each."""
    known = set(modules)
    found, graph = [], {m: set() for m in modules}
    # bench/ and lab/ modules by their bare names (`import common`): only a path edit could make those import
    bare = {m.split(".")[-1]: m for m in modules if room_of(m) in ("bench", "lab") and "." in m}
    for name, (source, is_package) in sorted(modules.items()):
        room = room_of(name)
        found += path_uses(name, source)
        for module, imported, line in imports_of(name, source, is_package, known):
            target = room_of(module)
            if module.split(".")[0] in TESTS_SUPPORT and room != "lab":
                found.append(f"{name} (line {line}) imports {module}: the tests' support (tests/support/) is "
                             "imported by nothing of the product; pass a test double in through an api parameter")
                continue
            if target is None:
                if module.split(".")[0] in bare:
                    found.append(f"{name} (line {line}) imports {module} by its bare name: import "
                                 f"{bare[module.split('.')[0]]} (a script's own folder is not a package path)")
                continue  # not the project's (the standard library, torch, ...)
            where = f"{name} (line {line}) imports {module}" + (f".{imported}" if imported else "")
            if module.split(".")[-1] == "__main__" and module != name:
                found.append(f"{where}: a command module; import the library module it calls")
            if (imported and _private(imported)) or any(_private(p) for p in module.split(".")):
                found.append(f"{where}: a private name; give it a public name in its module")
            if target == "lab" and room != "lab":
                found.append(f"{where}: the lab (lab/) is imported by nothing outside it; move what both need out "
                             "of lab/ (to bench/common.py, or the product)")
            allowed = MAY_IMPORT.get(room, ())
            if target != room and "*" not in allowed and not any(_matches(module, e) for e in allowed):
                found.append(f"{where}: room {room} may import only {', '.join(allowed) or 'nothing of the project'}"
                             " (tests/integration/test_import_dag.py MAY_IMPORT)")
            if module in graph and module != name:
                graph[name].add(module)
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) for each strongly connected group of more than one module."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:  # walk inside the group from its first module until a module repeats
        path = [min(group)]
        while True:
            nxt = min(w for w in graph[path[-1]] if w in group)
            if nxt in path:
                out.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
    return out


# ---------------------------------------------------------------- the tests


def test_the_project_keeps_the_import_dag():
    modules = project_sources()
    assert {"dflashkit.drafter.config", "dflashkit.extract.shards.reader", "dflashkit.train.trainer",
            "dflashkit.eval.run", "bench.bench_extract", "lab.recipe_study"} <= set(modules)
    unplaced = sorted(m for m in modules if room_of(m) is None)
    assert not unplaced, f"modules in no room of MAY_IMPORT: {unplaced}"
    found = violations(modules)
    assert not found, "\n".join(found)


def test_every_package_is_listed_for_a_non_editable_install():
    # `pip install .` ships only the packages pyproject.toml lists; the editable install finds the rest by itself
    listed = re.search(r"^packages = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    listed = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    packages = {m for m, (_, is_package) in project_sources().items()
                if is_package and room_of(m) not in ("bench", "lab")}  # run from a checkout, never installed
    assert "dflashkit.extract.shards" in packages
    assert packages - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(packages - listed)}"


def _tree(**sources) -> dict[str, tuple[str, bool]]:
    """Synthetic modules: keyword ``dflashkit__eval__run`` is module ``dflashkit.eval.run``."""
    return {k.replace("__", "."): (v, False) for k, v in sources.items()}


def test_the_checker_catches_each_kind_of_violation():
    clean = _tree(dflashkit__errors="", dflashkit__drafter__config="from dflashkit.errors import UserError",
                  dflashkit__targets__loading="from dflashkit.drafter.config import x",
                  dflashkit__extract__data__sources="def f():\n    from dflashkit.targets.loading import y",
                  dflashkit__eval__run="from dflashkit.extract.data.sources import f",
                  dflashkit__train__trainer="from dflashkit.extract.data import sources",
                  dflashkit__extract__run="from ..drafter import config", bench__common="",
                  bench__bench_vllm="from bench.common import QWEN3_8B\nfrom dflashkit.eval.run import f",
                  lab__recipe_study="from bench.common import say\nfrom dflashkit.train.trainer import g",
                  lab__standin_bench_vllm="from tests.support import vllm_standin",
                  lab__tests__test_recipe_study="from lab.recipe_study import main")
    assert violations(clean) == []
    breaks = {
        "drafter imports train": ("room drafter may import only helpers",
                                  _tree(dflashkit__drafter__config="from dflashkit.train import loss",
                                        dflashkit__train__loss="")),
        "eval imports a train internal": ("room eval may import only",
                                          _tree(dflashkit__eval__run="def f():\n    import dflashkit.train.step",
                                                dflashkit__train__step="")),
        "eval imports an extract internal": ("room eval may import only",
                                             _tree(dflashkit__eval__run="from dflashkit.extract.shards import writer",
                                                   dflashkit__extract__shards__writer="")),
        "shards import the generation front end": (
            "room extract.shards may import only helpers, drafter, targets",
            _tree(dflashkit__extract__shards__writer="from ..generation.generator import g",
                  dflashkit__extract__generation__generator="")),
        "the generation front end imports shards": (
            "room extract.generation may import only helpers, drafter, targets, extract.data",
            _tree(dflashkit__extract__generation__answerers="from ..shards import writer",
                  dflashkit__extract__shards__writer="")),
        "a command module": ("a command module", _tree(bench__b="from dflashkit.extract.__main__ import main",
                                                       dflashkit__extract____main__="")),
        "a private name": ("a private name", _tree(dflashkit__extract__shards__verify="from .format import _NP",
                                                   dflashkit__extract__shards__format="")),
        "a shipped modeling file uses a helper": (
            "room drafter.modeling_dflash may import only nothing",
            _tree(dflashkit__drafter__modeling_dflash="from dflashkit.errors import UserError", dflashkit__errors="")),
        "the product imports the lab": ("the lab (lab/) is imported by nothing outside it",
                                        _tree(dflashkit__train__trainer="from lab.recipe_study import VARIANTS",
                                              lab__recipe_study="")),
        "a command imports the lab lazily": ("dflashkit.demo (line 2) imports lab.recipe_study",
                                             _tree(dflashkit__demo="def f():\n    import lab.recipe_study",
                                                   lab__recipe_study="")),
        "a benchmark imports the lab": ("bench.bench_vllm (line 1) imports lab.time_to_quality.timeline: the lab",
                                        _tree(bench__bench_vllm="from lab.time_to_quality import timeline",
                                              lab__time_to_quality="")),
        "the product imports a test double": (
            "dflashkit.eval.run (line 1) imports tests.support.vllm_standin: the tests' support",
            _tree(dflashkit__eval__run="from tests.support.vllm_standin import standin_api")),
        "a benchmark imports a test double lazily": (
            "bench.bench_vllm (line 2) imports support: the tests' support",
            _tree(bench__bench_vllm="def f():\n    from support import vllm_standin")),
        "a path insert": ("lab.bench_x (line 3) uses sys.path",
                          _tree(lab__bench_x="import sys\n\nsys.path.insert(0, 'bench')\nimport common")),
        "a path insert, aliased": ("bench.bench_y (line 2) uses sys.path",
                                   _tree(bench__bench_y="import sys as s\ns.path[:0] = ['lab']")),
        "a bare name": ("lab.bench_y (line 2) imports bench_x by its bare name: import lab.bench_x",
                        _tree(lab__bench_x="", lab__bench_y="def f():\n    from bench_x import toy_inputs")),
        "a cycle": ("import cycle: dflashkit.train.a -> dflashkit.train.b -> dflashkit.train.a",
                    _tree(dflashkit__train__a="from . import b", dflashkit__train__b="def f():\n    from .a import x")),
    }
    for what, (expected, tree) in breaks.items():
        found = violations(tree)
        assert any(expected in line for line in found), f"{what}: not caught ({found})"


def test_the_table_in_architecture_md_is_the_tests_table():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([^|]*) \|", text, flags=re.M)
    documented = {room: tuple(re.findall(r"`([a-z_.*]+)`", allowed)) for room, allowed in rows if room in MAY_IMPORT}
    assert documented == MAY_IMPORT, "docs/ARCHITECTURE.md's import table differs from MAY_IMPORT"
