"""Settings travel as one object, not as long parameter lists: no function of the product (the mapped folders of
pyproject.toml and bench/) takes more than ten parameters (``self``/``cls`` not counted; ``*args``/``**kwargs``
count one each). Read with ``ast``, nothing imported.

Exempt, each for its reason: the Triton kernels and their launchers (``*_triton.py``: a ``@triton.jit`` kernel
takes its pointers, strides and sizes as flat arguments), and the tree-attention dispatch whose signature is the
kernel's (``eval/tree_attention.py`` ``tree_attention``, SDPA-style flat arguments).
"""

from __future__ import annotations

import ast

from support.paths import ROOT

FOLDERS = ("dflashkit", "drafter", "targets", "extract", "train", "eval", "bench")
LIMIT = 10
EXEMPT = {("eval/tree_attention.py", "tree_attention")}  # the kernel's own flat signature


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, parameter count) of every function of ``source`` with more than ``limit`` parameters."""
    return [(node.name, parameter_count(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > limit]


def test_the_counter_counts_every_kind_of_parameter():
    source = "def f(a, /, b, *c, d, e=1, **f): pass\nclass K:\n    def m(self, a, b): pass\n"
    assert long_functions(source, limit=5) == [("f", 6)]
    assert long_functions(source, limit=1) == [("f", 6), ("m", 2)]


def test_no_product_function_takes_more_than_ten_parameters():
    long = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.endswith("_triton.py"):
                continue
            long += [f"{rel}: {name} ({n})" for name, n in long_functions(path.read_text())
                     if (rel, name) not in EXEMPT]
    assert not long, f"{long}: group the settings into one options object (dflashkit/options.py, train/pass_options.py)"
