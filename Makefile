# One set of targets for a laptop, CI and the README.
# The first target run on a fresh machine creates .venv and installs fuseml into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU-only machines get the pinned CPU wheel of torch; a machine with an NVIDIA driver
# keeps whatever CUDA build of torch satisfies pyproject.toml.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAVE_GPU),torch>=2.6,torch==2.13.0)
# -o: pytest keeps the temporary folders of a run only when a test failed there.
PYTEST_ARGS ?= -n 2
SUITE ?= elementwise

.PHONY: demo test lint bench env gpu-check readme clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/fuseml demo

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS) tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

bench: $(VENV)/.installed
	$(VENV)/bin/fuseml bench $(SUITE)

env: $(VENV)/.installed
	$(VENV)/bin/fuseml env

# Regenerate the README's result tables from benchmarks/results.
readme: $(VENV)/.installed
	$(VENV)/bin/fuseml bench readme

gpu-check:
	scripts/gpu-check.sh out/gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
