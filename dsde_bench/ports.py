"""Free TCP ports for the servers a benchmark or a service test starts on this machine."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_GIVEN: set[int] = set()  # ports handed out by this process


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port nobody listens on now, between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral
    range. A port from bind(0) lies inside that range, so until its user binds it the outgoing connections and
    port-0 listeners of the processes started meanwhile (a Ray cluster opens many) can take it; here only an
    explicit bind can. Never the same port twice in a process."""
    low = max(_ephemeral_low(), 22000)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, low)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port below {low}")
