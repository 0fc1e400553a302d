"""Fixtures shared by every test (helpers that are not fixtures live in tests/support/, imported as
``from support.<module> import ...``; pyproject.toml's pytest settings put tests/ on the path and import test
modules by file path, so test modules never import each other).

- _seed: every test starts from torch seed 0.
- one_thread: one torch thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``).
- scratch: the system temporary directory pointed at an empty folder of the test's own.
- tiny_run: the tiny training target and its feature shards, once per session.
- fresh_accelerate_state (autouse): accelerate's class-level state reset after every test.

Hooks: the test files run longest first (tests/support/file_seconds.py), and a test worker of `make test` runs
torch on its share of the cores.
"""

import os
import sys

import pytest
import torch

from support.file_seconds import load_seconds, longest_first
from support.shards import make_shards
from support.tiny_targets import make_tiny_target


def pytest_configure(config):
    """In an xdist worker, torch's threads are the worker's share of the cores: `make test` starts one worker per
    core, and two workers of two threads each on two cores only wait on each other. The processes a test starts
    get the same count (OMP_NUM_THREADS): a run in a child process then computes bit for bit what the same run
    in the worker computes (a matmul split over another number of threads can round differently; the
    resume-equals-uninterrupted extraction test compares the two exactly)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    """The files in order of their measured seconds, longest first (each file's tests in their own order): with
    ``--dist loadfile --no-loadscope-reorder`` the workers take the long files first and end close together."""
    order = longest_first(list(dict.fromkeys(item.nodeid.split("::")[0] for item in items)), load_seconds())
    rank = {path: k for k, path in enumerate(order)}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and lose a lot to them on a shared machine
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module that wants it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The system temporary directory, pointed at an empty folder (a vLLM twin's engine files must not outlive
    their engine: the folder is empty again after it)."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(target dir, shard dir) shared by the trainer tests."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(root / "target")
    return target, make_shards(root / "shards", target)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """After every test: accelerate keeps its state (mixed precision, device) in class attributes, so a training
    in one test would otherwise fix them for the next (on a GPU a bf16 training made the packing tests' fp32 runs
    fail, lab/NOTEBOOK.md "The recipe study")."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
