"""Which runner runs a model: the torch forward (llama.py, runner.py) or llama.cpp (llama_cpp.py).

Both sit behind the same seam (runner.Runner), so the workers, the engine and the policies never know which ran.

- `torch`: any device, bfloat16 or float32; in float32 it is the bit-exact reference against transformers.
- `llama.cpp`: a GGUF file (an embedded model or a local .gguf) run as it is, on the CPU: its quantized kernels read
  a Q4_K_M file's ~4.5 bits a weight where the torch forward reads a bf16 conversion's 16, and nothing is converted.
- `auto`: llama.cpp for a GGUF model on a CPU when llama-cpp-python is installed and the dtype is not float32 (which
  asks for the bit-exact reference); torch otherwise (a Hugging Face directory, a GPU, float32).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dsde_core.errors import ConfigError
from dsde_core.models.packaged import EMBEDDED

BACKENDS = ("auto", "torch", "llama.cpp")
# the torch runner's step: "eager" (ModelRunner: any shape, the CPU's) or "static" (static_step.StaticRunner: bucketed
# decode and verify forwards over persistent buffers; on CUDA captured as graphs, with fused small ops)
STEPS = ("eager", "static")


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python is installed (checked without importing it: the import loads the library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def is_gguf_source(source: str) -> bool:
    """An embedded model (shipped as GGUF) or a local .gguf file."""
    path = Path(os.path.expanduser(source))
    return source in EMBEDDED or (path.is_file() and path.suffix.lower() == ".gguf")


def resolve_backend(backend: str, source: str, device: str, dtype: str) -> str:
    """The runner `source` loads with on `device` ("cpu", "cuda[:N]"): "torch" or "llama.cpp". ConfigError for a
    backend that cannot run there (llama.cpp on a GPU); llama.cpp for a source that is no GGUF fails when it loads,
    naming the source."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}", "backend")
    on_cpu = device == "cpu"
    if backend == "llama.cpp" and not on_cpu:
        raise ConfigError(f"backend llama.cpp runs on the CPU; device {device!r} needs backend torch", "backend")
    if backend != "auto":
        return backend
    if on_cpu and dtype not in ("float32", "fp32") and is_gguf_source(source) and llama_cpp_available():
        return "llama.cpp"
    return "torch"
