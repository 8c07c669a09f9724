"""Counting what stalls a device step: host synchronisations and data-dependent ops.

A GPU step is one stream of launches only while nothing in it waits for a value the device computes: reading a
tensor on the host (.item(), .tolist(), bool(), .numpy(), .cpu()) and ops whose output shape depends on the data
(nonzero, a boolean-mask index, unique, repeat_interleave without an output size) each synchronise, and a captured
CUDA graph cannot hold them. SyncCounter records both kinds, on any device, so a CPU test guards the GPU path:
- the reads at the Python API (a TorchFunctionMode: on the CPU they never reach the dispatcher);
- the data-dependent ops at torch's dispatcher (a TorchDispatchMode: also those inside composite ops).
"""

from __future__ import annotations

from collections import Counter
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT_OPS = frozenset({
    "aten.nonzero", "aten.masked_select", "aten.unique_consecutive", "aten._unique2", "aten.unique_dim",
    "aten.repeat_interleave", "aten.argwhere", "aten.equal",
})  # (a host read of a value, aten._local_scalar_dense, is counted where Python asks for it: HOST_READS)
HOST_READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
              torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu", torch.Tensor.__int__: "int",
              torch.Tensor.__float__: "float"}


class _Reads(TorchFunctionMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS:
            self.counts[HOST_READS[func]] += 1
        elif func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None):
            self.counts["bool-index"] += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func.overloadpacket)  # "aten.nonzero"
        if name in DATA_DEPENDENT_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter:
    """`with SyncCounter() as c: ...` -> c.syncs, a Counter of the host reads and data-dependent ops run inside."""

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        self._modes = (_Reads(self.syncs), _Ops(self.syncs))

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(kind, err, tb)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())
