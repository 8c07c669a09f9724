"""Counting what stalls a device step: host synchronisations and data-dependent ops, and the step's uploads.

A GPU step is one stream of launches only while nothing in it waits for a value the device computes: reading a
tensor on the host (.item(), .tolist(), bool(), .numpy(), .cpu()) and ops whose output shape depends on the data
(nonzero, a boolean-mask index, unique, repeat_interleave without an output size) each synchronise, and a captured
CUDA graph cannot hold them. SyncCounter records both kinds, on any device, so a CPU test guards the GPU path:
- the reads at the Python API (a TorchFunctionMode: on the CPU they never reach the dispatcher);
- the data-dependent ops at torch's dispatcher (a TorchDispatchMode: also those inside composite ops).
Beside them it counts the uploads, host values put on a device: torch.tensor or torch.as_tensor of host data with a
device named, Tensor.to with a device named, Tensor.cuda, and the pinned packet's copy (Tensor.copy_ with
non_blocking=True). Each is a copy of its own on a GPU (from pageable memory one that blocks the host), so a step
that sends its inputs in one packet (dsde_core/packet.py) counts one upload a pass. On the CPU the calls are
counted all the same, whatever device they name.
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
    def __init__(self, counts: Counter[str], uploads: Counter[str]) -> None:
        super().__init__()
        self.counts, self.uploads = counts, uploads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READS:
            self.counts[HOST_READS[func]] += 1
        elif func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None):
            self.counts["bool-index"] += 1
        elif upload := _upload(func, args, kwargs):
            self.uploads[upload] += 1
        return func(*args, **kwargs)


def _upload(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The upload a call is (the module's kinds), or None."""
    if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
        return None if func is torch.as_tensor and isinstance(args[0], torch.Tensor) else func.__name__
    if func is torch.Tensor.to and (kwargs.get("device") is not None
                                    or any(isinstance(a, (torch.device, str)) for a in args[1:])):
        return "to"
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is torch.Tensor.copy_ and kwargs.get("non_blocking", len(args) > 2 and args[2]):
        return "copy"
    return None


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
    """`with SyncCounter() as c: ...` -> c.syncs, a Counter of the host reads and data-dependent ops run inside, and
    c.uploads, one of the uploads."""

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()
        self._modes = (_Reads(self.syncs, self.uploads), _Ops(self.syncs))

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
