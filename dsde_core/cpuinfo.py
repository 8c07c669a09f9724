"""What this CPU reports about itself (Linux /proc/cpuinfo): its model name and feature flags, read once."""

from __future__ import annotations

import platform
from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU listed; where /proc/cpuinfo cannot be read, (platform.processor() or
    "unknown", no flags)."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags
