#!/usr/bin/env bash
# The checks that need a GPU, in one call of a lent machine (docs/benchmarks.md, "On a GPU"), under 8 minutes: the
# engine's tests with the tiny models on CUDA (lossless speculation on the static step, sampling, host reads a step,
# the cost-aware policy, recovery), then the device step (benchmarks/gpu_step.py: graphs against eager, the Triton
# kernel, the sampler on the device, per-forward ms against the bandwidth floor, engine tokens/s at controlled
# acceptance, and the static step's cost table for the simulator). Needs python3 with torch (CUDA), Triton,
# transformers and pytest; writes to $OUT.
# Usage: OUT=DIR benchmarks/gpu_check.sh CONFIGS_DIR   (CONFIGS_DIR holds target.json and draft.json)
set -uo pipefail
configs=${1:?usage: gpu_check.sh CONFIGS_DIR}
out=${OUT:?set OUT to the folder for the results}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/device.txt"
DSDE_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= \
  tests/test_engine.py tests/test_static_step.py tests/test_step_syncs.py tests/test_goodput.py \
  tests/test_engine_recovery.py tests/test_logprobs.py tests/test_logits_processors.py tests/test_chunked_prefill.py \
  2>&1 | tee "$out/pytest_cuda.log" | tail -n 40
echo "pytest rc ${PIPESTATUS[0]}"
timeout 330 python3 benchmarks/gpu_step.py --configs "$configs" --out "$out/step_gpu.json" \
  --costs-out "$out/costs_step_gpu.json" --budget 270 2>&1 | tee "$out/gpu_step.log"
echo "gpu_step rc ${PIPESTATUS[0]}"
