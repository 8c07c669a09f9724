"""llama.cpp's own server as a measured peer: built once from the llama-cpp-python sdist (which vendors llama.cpp's
whole source), started on the same GGUF files, and timed over HTTP as a client would.

    binary = ensure_llama_server()                       # first use: pip download + cmake, minutes; then cached
    with LlamaServer(binary, target_gguf, draft_gguf, extra=("--spec-draft-n-max", "16")) as server:
        tokens, seconds = server.complete(prompt_ids, max_tokens=128)

The build lands in $XDG_CACHE_HOME/dsde/llama.cpp/<version>/ (default ~/.cache/...): the same llama.cpp version as
the llama-cpp-python our llama.cpp backend runs on, built for this machine's CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from dsde_bench.ports import free_port
from dsde_core.errors import DSDEError
from dsde_core.models.llama_cpp import cpu_has_amx
from dsde_core.models.packaged import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist the server is built from: the version pyproject.toml pins


class LlamaServerError(DSDEError, RuntimeError):
    """llama-server could not be built, did not start, or answered with an error."""


def build_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    return cache_root().parent / "llama.cpp" / version


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON, jobs: int | None = None, log: Path | None = None) -> Path:
    """The llama-server binary, built on first use: the sdist from the package index (`pip download`), llama.cpp's
    CMake build of the `llama-server` target only (Release, no curl). Several minutes on 2 cores; the build's output
    goes to `log` (default: build.log beside the binary)."""
    root = build_dir(version)
    binary = root / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    log = log or root / "build.log"
    with open(log, "w") as out:
        def run(*cmd: str, cwd: Path | None = None) -> None:
            print(f"llama-server: {' '.join(cmd)}", file=sys.stderr, flush=True)
            if subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise LlamaServerError(f"building llama-server failed at `{' '.join(cmd)}`; its output: {log}")

        sdist = root / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            run(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={version}", "-d", str(root))
        src = root / f"llama_cpp_python-{version}"
        if not src.is_dir():
            with tarfile.open(sdist) as tar:
                tar.extractall(root, filter="data")
        llama = src / "vendor" / "llama.cpp"
        run("cmake", "-S", str(llama), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF")
        run("cmake", "--build", str(root / "build"), "-j", str(jobs or os.cpu_count() or 2), "--target",
            "llama-server")
    if not binary.is_file():
        raise LlamaServerError(f"the build finished without {binary}; its output: {log}")
    shutil.rmtree(src, ignore_errors=True)  # 300+ MB of sources; build/bin holds the binary and its libraries
    return binary


def default_flags() -> list[str]:
    """Flags every run of the peer takes: no weight repacking where the CPU has AMX (llama.cpp's AMX matmul crashes
    on these Q4_K_M files; our llama.cpp backend turns the same buffers off there)."""
    return ["--no-repack"] if cpu_has_amx() else []


class LlamaServer:
    """A llama-server process on a free local port: the target, optionally a draft (`-md`), `parallel` slots of
    `ctx` tokens each, `threads` threads; stopped on exit."""

    def __init__(self, binary: Path, target: Path, draft: Path | None = None, parallel: int = 1, ctx: int = 2048,
                 threads: int | None = None, extra: Sequence[str] = (), start_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads = threads or len(os.sched_getaffinity(0))
        self.cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx * parallel),
                    "--no-webui", *default_flags()]
        if draft is not None:
            self.cmd += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        self.cmd += list(extra)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log"

    def __enter__(self) -> LlamaServer:
        self._log_file = open(self.log, "w")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited with {self.proc.returncode} at start: {self._tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), \
                    urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                if r.status == 200:
                    return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise LlamaServerError(f"llama-server did not answer /health within {self.start_timeout_s:g}s: {self._tail()}")

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def _tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def complete(self, prompt_ids: list[int], max_tokens: int, timeout_s: float = 600.0) -> tuple[list[int], float]:
        """One greedy completion of the prompt's token ids (the same tokens our engine is given), generating max_tokens
        past any end of text, no prompt cache: (its token ids, seconds end to end)."""
        body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(f"{self.url}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                doc = json.loads(r.read())
        except urllib.error.URLError as e:
            raise LlamaServerError(f"llama-server failed a completion: {e}; {self._tail()}") from e
        return [int(t) for t in doc["tokens"]], time.perf_counter() - t0
