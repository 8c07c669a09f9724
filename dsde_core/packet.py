"""A pass's host-built inputs, sent to the device in one copy.

Each small tensor made on the host and moved to the device alone is a copy of its own: on a GPU a launch, and from
pageable memory one that blocks the host. A Packet gathers a pass's host values instead (uniforms, drafts and their
distributions, sampling parameters, positions, table updates) and sends them at once: packed as parts of one int32
buffer (an integer part by its value, which must fit int32, a float part by its fp32 bits, so the values arrive
exactly), copied once (from pinned memory, not blocking, on CUDA) and cut into views on the device. Where the device
is the CPU there is nothing to copy, and packing would only add work: each part stays the host tensor it was made as
(PACK_ALWAYS packs there too, so that the tests run the GPU's path on the CPU). Either way a part reads back as int64
(ints), bool (bools) or float32 (floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PACK_ALWAYS = False  # pack on the CPU too (tests)


@dataclass(frozen=True)
class Part:
    """One value of a packet: its index among the parts."""

    index: int


class Packet:
    """`p = Packet(); a = p.ints(...); b = p.floats(...); p.send(dev)` -> p[a], p[b] on dev (one copy)."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []  # on the host: int64, bool or float32
        self._sent: list[torch.Tensor] | None = None  # the parts on the device, once sent

    def ints(self, values: Any) -> Part:
        """Integers (a nested list or a host tensor; each in int32's range) -> their part, read as int64."""
        return self._add(torch.as_tensor(values, dtype=torch.long))

    def bools(self, values: Any) -> Part:
        """Truth values (a list or a host tensor) -> their part, read as bool."""
        return self._add(torch.as_tensor(values, dtype=torch.bool))

    def floats(self, values: Any) -> Part:
        """Numbers (a nested list or a host tensor) -> their part, read as float32 (the values rounded to fp32)."""
        return self._add(torch.as_tensor(values, dtype=torch.float32))

    def _add(self, part: torch.Tensor) -> Part:
        if self._sent is not None:
            raise RuntimeError("a packet takes no parts once sent")
        self._parts.append(part)
        return Part(len(self._parts) - 1)

    def send(self, device: torch.device | str) -> None:
        """The one copy: every part to `device`."""
        device = torch.device(device)
        if device.type == "cpu" and not PACK_ALWAYS:
            self._sent = self._parts
            return
        words = [(p.view(torch.int32) if p.is_floating_point() else p.to(torch.int32)).reshape(-1)
                 for p in self._parts]
        host = torch.cat(words) if words else torch.zeros(0, dtype=torch.int32)  # [size]
        sent = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        self._sent = [w.view(torch.float32).view(p.shape) if p.is_floating_point() else w.view(p.shape).to(p.dtype)
                      for p, w in zip(self._parts, sent.split([len(w) for w in words]), strict=True)]

    def __getitem__(self, part: Part) -> torch.Tensor:
        if self._sent is None:
            raise RuntimeError("a packet's parts are read once it is sent")
        return self._sent[part.index]
