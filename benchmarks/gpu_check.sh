#!/usr/bin/env bash
# The checks that need a GPU, in one call of a lent machine (docs/benchmarks.md, "On a GPU"): the engine's tests with the tiny
# models on CUDA (lossless speculation, sampling, the cost-aware policy, recovery), the embedded pair's step costs
# there (benchmarks/gpu_costs.py), then the device step's parts (benchmarks/gpu_step.py: the Triton attention kernel
# against the torch path, the batched sampler on the device). Needs python3 with torch (CUDA), Triton, transformers
# and pytest; writes to $OUT.
# Usage: OUT=DIR benchmarks/gpu_check.sh CONFIGS_DIR   (CONFIGS_DIR holds target.json and draft.json)
set -uo pipefail
configs=${1:?usage: gpu_check.sh CONFIGS_DIR}
out=${OUT:?set OUT to the folder for the results}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/device.txt"
DSDE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts= \
  tests/test_engine.py tests/test_goodput.py tests/test_async_engine.py tests/test_engine_recovery.py \
  tests/test_logprobs.py tests/test_logits_processors.py tests/test_chunked_prefill.py \
  2>&1 | tee "$out/pytest_cuda.log" | tail -n 40
echo "pytest rc ${PIPESTATUS[0]}"
timeout 240 python3 benchmarks/gpu_costs.py --configs "$configs" --out "$out/costs_gpu.json" 2>&1 \
  | tee "$out/gpu_costs.log"
echo "gpu_costs rc ${PIPESTATUS[0]}"
timeout 300 python3 benchmarks/gpu_step.py --configs "$configs" --out "$out/step_gpu.json" --budget 240 2>&1 \
  | tee "$out/gpu_step.log"
echo "gpu_step rc ${PIPESTATUS[0]}"
