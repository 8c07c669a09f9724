"""The scripts under benchmarks/ (plain scripts, not a package), loaded for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str) -> ModuleType:
    """benchmarks/<name>.py, loaded as the module `name`; its siblings import by name while it loads, as when it runs
    from benchmarks/."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: its dataclasses look their module up while it runs
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
